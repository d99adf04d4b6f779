//! OpenID Connect end to end: agentry configured with `[auth.oidc]` against a real
//! OpenID Provider (tests/support/oidc_idp.rs) on 127.0.0.1. Tokens come from the
//! provider itself — its token endpoint, or its signing key for tokens whose claims a
//! test chooses — and every refusal is checked for its exact code.

#[path = "api/helpers.rs"]
#[allow(dead_code)]
mod helpers;

#[path = "support/oidc_idp.rs"]
#[allow(dead_code)]
mod oidc_idp;

use std::time::Duration;

use agentry::config::{GroupMapping, OidcSettings, Settings};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::{Value, json};

use helpers::{TestApp, expect_status, spawn_app_with};
use oidc_idp::{Idp, user};

fn oidc_settings(idp: &Idp) -> OidcSettings {
    let mut o = OidcSettings::new(idp.issuer.clone(), vec!["agentry".into()]);
    o.groups.insert(
        "eng".into(),
        GroupMapping {
            team: "platform".into(),
            role: "member".into(),
        },
    );
    o.groups.insert(
        "eng-leads".into(),
        GroupMapping {
            team: "platform".into(),
            role: "owner".into(),
        },
    );
    o
}

async fn app_for(idp: &Idp, tweak: impl FnOnce(&mut OidcSettings)) -> TestApp {
    let mut o = oidc_settings(idp);
    tweak(&mut o);
    let app = spawn_app_with(move |s: &mut Settings| s.auth.oidc = Some(o)).await;
    wait_ready(&app).await;
    app
}

async fn wait_ready(app: &TestApp) {
    for _ in 0..200 {
        let res = app.client.get(app.url("/readyz")).send().await.unwrap();
        if res.status() == 200 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the server did not become ready");
}

async fn get_as(app: &TestApp, token: &str, path: &str) -> reqwest::Response {
    app.client
        .get(app.url(path))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
}

/// 401 with exactly `code`, the bearer challenge, and no key material in the answer.
async fn refused(app: &TestApp, token: &str, code: &str, key_material: &str) {
    let res = get_as(app, token, "/v1/me").await;
    let challenge = res
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = expect_status(res, 401).await;
    assert_eq!(body["code"], code, "{body}");
    assert!(
        challenge.starts_with("Bearer error=\"invalid_token\""),
        "{challenge}"
    );
    let text = body.to_string();
    assert!(
        !text.contains(&key_material[..16]),
        "the answer shows key material: {text}"
    );
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

/// The modulus of the provider's current key, to check that no answer shows it.
async fn modulus(idp: &Idp) -> String {
    let jwks: Value = reqwest::get(format!("{}/jwks", idp.issuer))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    jwks["keys"][0]["n"].as_str().unwrap().to_owned()
}

fn b64(v: &Value) -> String {
    URL_SAFE_NO_PAD.encode(v.to_string())
}

#[tokio::test]
async fn tokens_from_the_provider_are_accepted_and_users_upserted() {
    let idp = Idp::start().await;
    let app = app_for(&idp, |_| {}).await;

    // A service client (client credentials grant).
    let bot = idp.client_credentials("ci-bot").await;
    let me = expect_status(get_as(&app, &bot, "/v1/me").await, 200).await;
    assert!(me["id"].as_str().unwrap().starts_with("usr_"), "{me}");
    assert_eq!(me["name"], "ci-bot");
    assert_eq!(me["is_admin"], false);
    assert_eq!(me["teams"], json!([]));

    // A person (authorization code flow with PKCE), in two mapped groups of one team.
    idp.set_user(user("alice", &["eng", "eng-leads", "unmapped"]));
    let tokens = idp.authorization_code("agentry-web").await;
    let alice = tokens["access_token"].as_str().unwrap();
    let me = expect_status(get_as(&app, alice, "/v1/me").await, 200).await;
    assert_eq!(me["email"], "alice@example.com");
    assert_eq!(me["name"], "User alice");
    let teams = me["teams"].as_array().unwrap();
    assert_eq!(teams.len(), 1, "{me}");
    assert_eq!(teams[0]["name"], "platform");
    assert_eq!(teams[0]["role"], "owner", "the highest mapped role");

    // Seen again with a new email: the same user, refreshed.
    let mut changed = user("alice", &["eng"]);
    changed["email"] = json!("alice@new.example.com");
    idp.set_user(changed);
    let tokens = idp.authorization_code("agentry-web").await;
    let again = expect_status(
        get_as(&app, tokens["access_token"].as_str().unwrap(), "/v1/me").await,
        200,
    )
    .await;
    assert_eq!(again["id"], me["id"]);
    assert_eq!(again["email"], "alice@new.example.com");
    assert_eq!(again["teams"][0]["role"], "member");

    // The ID token is for the client, not for this API.
    let id_token = tokens["id_token"].as_str().unwrap();
    refused(
        &app,
        id_token,
        "token_invalid_audience",
        &modulus(&idp).await,
    )
    .await;

    // Local mode stays on beside OIDC: the bootstrap admin token still works.
    let admin = app.get_ok("/v1/me").await;
    assert_eq!(admin["is_admin"], true);
    // An API-token-shaped string is never sent to the provider.
    let res = get_as(&app, "agt_pat_nope", "/v1/me").await;
    assert_eq!(expect_status(res, 401).await["code"], "token_malformed");
}

#[tokio::test]
async fn the_attack_suite_is_refused_with_precise_codes() {
    let idp = Idp::start_with(0, Some("shared-kid")).await;
    let other = Idp::start_with(0, Some("shared-kid")).await;
    let app = app_for(&idp, |_| {}).await;
    let n = modulus(&idp).await;
    let claims = |over: Value| {
        let mut c = json!({"iss": idp.issuer, "aud": "agentry", "sub": "mallory",
            "iat": now(), "exp": now() + 600});
        for (k, v) in over.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    };

    // The control: claims chosen by the test, signed with the provider's key, pass.
    let good = idp.sign("current", json!({}), claims(json!({}))).await;
    expect_status(get_as(&app, &good, "/v1/me").await, 200).await;

    // alg: none, no signature.
    let none = format!(
        "{}.{}.",
        b64(&json!({"alg": "none", "typ": "JWT"})),
        b64(&claims(json!({})))
    );
    refused(&app, &none, "token_algorithm_not_allowed", &n).await;
    // HS256 keyed with the provider's RSA public key (PEM) — the key-confusion attack.
    let hs = idp
        .sign("hs256-public-pem", json!({}), claims(json!({})))
        .await;
    refused(&app, &hs, "token_algorithm_not_allowed", &n).await;
    // An allowed algorithm that does not fit the named key's type (ES256 on an RSA key).
    let parts: Vec<&str> = good.split('.').collect();
    let es = format!(
        "{}.{}.{}",
        b64(&json!({"alg": "ES256", "kid": "shared-kid"})),
        parts[1],
        URL_SAFE_NO_PAD.encode([7u8; 64])
    );
    refused(&app, &es, "token_algorithm_not_allowed", &n).await;

    let signed = |over: Value| idp.sign("current", json!({}), claims(over));
    refused(
        &app,
        &signed(json!({"exp": now() - 3600})).await,
        "token_expired",
        &n,
    )
    .await;
    refused(
        &app,
        &signed(json!({"nbf": now() + 3600})).await,
        "token_not_yet_valid",
        &n,
    )
    .await;
    // A time claim of the wrong type is refused, not skipped.
    refused(
        &app,
        &signed(json!({"nbf": (now() + 3600).to_string()})).await,
        "token_malformed",
        &n,
    )
    .await;
    refused(
        &app,
        &signed(json!({"iat": now() + 3600})).await,
        "token_not_yet_valid",
        &n,
    )
    .await;
    refused(
        &app,
        &signed(json!({"iss": "http://127.0.0.1:1"})).await,
        "token_invalid_issuer",
        &n,
    )
    .await;
    refused(
        &app,
        &signed(json!({"aud": ["someone-else"]})).await,
        "token_invalid_audience",
        &n,
    )
    .await;
    let no_exp = {
        let mut c = claims(json!({}));
        c.as_object_mut().unwrap().remove("exp");
        idp.sign("current", json!({}), c).await
    };
    refused(&app, &no_exp, "token_malformed", &n).await;

    // A key the provider does not publish.
    let foreign = idp.sign("foreign", json!({}), claims(json!({}))).await;
    refused(&app, &foreign, "token_unknown_key", &n).await;

    // A tampered payload under the original signature.
    let tampered = format!(
        "{}.{}.{}",
        parts[0],
        b64(&claims(json!({"sub": "admin"}))),
        parts[2]
    );
    refused(&app, &tampered, "token_invalid_signature", &n).await;

    // A second provider whose key has the same kid.
    let theirs = other.client_credentials("ci-bot").await;
    assert!(theirs.starts_with("eyJ"));
    refused(&app, &theirs, "token_invalid_signature", &n).await;

    // A huge token.
    let huge = format!(
        "{}.{}.{}",
        parts[0],
        b64(&claims(json!({"pad": "x".repeat(20_000)}))),
        parts[2]
    );
    refused(&app, &huge, "token_too_large", &n).await;

    // A JWT-shaped string that is not one.
    refused(&app, "eyJub3QganNvbg.e30.c2ln", "token_malformed", &n).await;
}

/// A field of the provider's current public key, to check that no answer shows it.
async fn published(idp: &Idp, field: &str) -> String {
    let jwks: Value = reqwest::get(format!("{}/jwks", idp.issuer))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    jwks["keys"][0][field].as_str().unwrap().to_owned()
}

fn header_of(token: &str) -> Value {
    serde_json::from_slice(
        &URL_SAFE_NO_PAD
            .decode(token.split('.').next().unwrap())
            .unwrap(),
    )
    .unwrap()
}

#[tokio::test]
async fn every_algorithm_allowed_by_default_verifies_a_provider_signature() {
    let idp = Idp::start().await;
    let app = app_for(&idp, |o| o.jwks_refetch_min_interval_s = 0).await;
    let defaults = OidcSettings::new(idp.issuer.clone(), vec!["agentry".into()]).allowed_algs;
    for alg in ["RS256", "PS256", "ES256", "EdDSA"] {
        assert!(defaults.iter().any(|a| a == alg), "{alg} in {defaults:?}");
    }
    for alg in &defaults {
        // The provider's own token endpoint signs with a key of this algorithm.
        let kid = idp.rotate_to(alg).await;
        let token = idp.client_credentials("ci-bot").await;
        let header = header_of(&token);
        assert_eq!(header["alg"], alg.as_str(), "{header}");
        assert_eq!(header["kid"], kid.as_str(), "{header}");
        let me = expect_status(get_as(&app, &token, "/v1/me").await, 200).await;
        assert_eq!(me["name"], "ci-bot", "{alg}: {me}");
    }

    // A valid signature with an algorithm the settings do not allow (supported, and
    // not a default).
    assert!(!defaults.iter().any(|a| a == "ES384"), "{defaults:?}");
    idp.rotate_to("ES384").await;
    let token = idp.client_credentials("ci-bot").await;
    assert_eq!(header_of(&token)["alg"], "ES384");
    let x = published(&idp, "x").await;
    refused(&app, &token, "token_algorithm_not_allowed", &x).await;

    // An allowed algorithm on the right key material, but not the one its JWK names:
    // RS256 with the RSA key published for PS256.
    idp.rotate_to("PS256").await;
    let claims = json!({"iss": idp.issuer, "aud": "agentry", "sub": "mallory",
        "iat": now(), "exp": now() + 600});
    let n = published(&idp, "n").await;
    let control = idp.sign("current", json!({}), claims.clone()).await;
    assert_eq!(header_of(&control)["alg"], "PS256");
    expect_status(get_as(&app, &control, "/v1/me").await, 200).await;
    let mismatched = idp.sign_as("RS256", claims).await;
    assert_eq!(header_of(&mismatched)["alg"], "RS256");
    refused(&app, &mismatched, "token_algorithm_not_allowed", &n).await;
}

#[tokio::test]
async fn rotated_keys_validate_without_a_restart_and_removed_keys_stop() {
    let idp = Idp::start().await;
    let app = app_for(&idp, |o| o.jwks_refetch_min_interval_s = 0).await;
    let old = idp.client_credentials("ci-bot").await;
    expect_status(get_as(&app, &old, "/v1/me").await, 200).await;

    let kid = idp.rotate().await;
    let new = idp.client_credentials("ci-bot").await;
    let header: Value = serde_json::from_slice(
        &URL_SAFE_NO_PAD
            .decode(new.split('.').next().unwrap())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(header["kid"], kid.as_str());
    // The new key is fetched on first sight of its kid…
    expect_status(get_as(&app, &new, "/v1/me").await, 200).await;
    // …and the refetch dropped the removed key.
    let res = get_as(&app, &old, "/v1/me").await;
    assert_eq!(expect_status(res, 401).await["code"], "token_unknown_key");
}

#[tokio::test]
async fn unknown_key_refetches_are_rate_limited() {
    let idp = Idp::start().await;
    let app = app_for(&idp, |o| o.jwks_refetch_min_interval_s = 3600).await;
    idp.rotate().await;
    let new = idp.client_credentials("ci-bot").await;
    // The keys were fetched at start, less than an hour ago: no refetch yet.
    let res = get_as(&app, &new, "/v1/me").await;
    assert_eq!(expect_status(res, 401).await["code"], "token_unknown_key");
}

#[tokio::test]
async fn leaving_an_idp_group_removes_the_team_on_the_next_request() {
    let idp = Idp::start().await;
    let app = app_for(&idp, |_| {}).await;
    idp.set_user(user("bob", &["eng"]));
    let tokens = idp.authorization_code("agentry-web").await;
    let bob = tokens["access_token"].as_str().unwrap().to_owned();
    let me = expect_status(get_as(&app, &bob, "/v1/me").await, 200).await;
    let team = me["teams"][0]["id"].as_str().unwrap().to_owned();

    // A project of the mapped team, made by the admin.
    let repo = helpers::git_repo();
    let project = app
        .post_ok(
            "/v1/projects",
            json!({"name": "svc", "team_id": team, "repo_path": repo.path()}),
            201,
        )
        .await;
    let path = format!("/v1/projects/{}", project["id"].as_str().unwrap());
    expect_status(get_as(&app, &bob, &path).await, 200).await;

    // The provider drops bob from the group: his next token loses the team.
    idp.set_user(user("bob", &[]));
    let tokens = idp.authorization_code("agentry-web").await;
    let bob = tokens["access_token"].as_str().unwrap();
    let res = get_as(&app, bob, &path).await;
    assert_eq!(expect_status(res, 404).await["code"], "not_found");
    let me = expect_status(get_as(&app, bob, "/v1/me").await, 200).await;
    assert_eq!(me["teams"], json!([]));
    // Teams the mapping does not name are left alone: the admin's own team stays.
    let admin = app.get_ok("/v1/me").await;
    assert_eq!(admin["teams"][0]["name"], "default");
}

#[tokio::test]
async fn readiness_waits_for_the_identity_provider() {
    // A port with nothing listening yet; the provider comes up there later.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let issuer = format!("http://127.0.0.1:{port}");
    let o = OidcSettings::new(issuer, vec!["agentry".into()]);
    let app = spawn_app_with(move |s: &mut Settings| s.auth.oidc = Some(o)).await;
    for _ in 0..3 {
        let res = app.client.get(app.url("/readyz")).send().await.unwrap();
        assert_eq!(expect_status(res, 503).await["code"], "not_ready");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // A JWT meanwhile: the server cannot check it yet, and says so.
    let early = format!(
        "{}.{}.c2ln",
        b64(&json!({"alg": "RS256", "kid": "k"})),
        b64(&json!({}))
    );
    let res = get_as(&app, &early, "/v1/me").await;
    assert_eq!(expect_status(res, 503).await["code"], "idp_unavailable");
    // API tokens work all along.
    app.get_ok("/v1/me").await;

    let idp = Idp::start_with(port, None).await;
    wait_ready(&app).await;
    let bot = idp.client_credentials("ci-bot").await;
    expect_status(get_as(&app, &bot, "/v1/me").await, 200).await;
}

/// An app whose browser sign-in redirects back to itself, and a client that follows no
/// redirects (each hop is checked).
async fn browser_app(idp: &Idp) -> (TestApp, reqwest::Client) {
    browser_app_with(idp, |_| {}).await
}

/// Like `browser_app`, with settings adjusted by `tweak`.
async fn browser_app_with(
    idp: &Idp,
    tweak: impl FnOnce(&mut Settings),
) -> (TestApp, reqwest::Client) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut o = oidc_settings(idp);
    o.client_id = Some("agentry-web".into());
    o.redirect_url = Some(format!("http://127.0.0.1:{port}/auth/callback"));
    let app = helpers::spawn_app_on(listener, move |s: &mut Settings| {
        s.auth.oidc = Some(o);
        tweak(s);
    })
    .await;
    wait_ready(&app).await;
    let browser = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    (app, browser)
}

fn location(res: &reqwest::Response) -> String {
    assert_eq!(res.status(), 302, "a redirect");
    res.headers()["location"].to_str().unwrap().to_owned()
}

/// The pre-login cookie (name=value) `GET /auth/login` set, checked for its attributes.
fn login_cookie(res: &reqwest::Response) -> String {
    let set = res
        .headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .find(|c| c.starts_with("agentry_login="))
        .expect("a pre-login cookie");
    for a in ["HttpOnly", "SameSite=Lax", "Path=/auth", "Max-Age=600"] {
        assert!(set.contains(a), "{a} in {set}");
    }
    // The redirect URL is http here: a Secure cookie would never come back.
    assert!(!set.contains("Secure"), "{set}");
    set.split_once(';').unwrap().0.to_owned()
}

/// Sign in through the real redirects: agentry → provider → agentry's callback. Returns
/// the session cookie (name=value), its attributes, and the callback URL used.
async fn sign_in(
    app: &TestApp,
    browser: &reqwest::Client,
    return_to: &str,
) -> (String, String, String) {
    let res = browser
        .get(app.url(&format!("/auth/login?return_to={return_to}")))
        .send()
        .await
        .unwrap();
    let to_idp = location(&res);
    let pre_login = login_cookie(&res);
    let authorize = url::Url::parse(&to_idp).unwrap();
    let q: std::collections::HashMap<String, String> =
        authorize.query_pairs().into_owned().collect();
    assert_eq!(q["code_challenge_method"], "S256");
    assert_eq!(q["response_type"], "code");
    assert_eq!(q["client_id"], "agentry-web");
    assert!(q["code_challenge"].len() >= 43 && q["state"].len() >= 32 && q["nonce"].len() >= 32);
    let res = browser.get(&to_idp).send().await.unwrap();
    let back = location(&res);
    assert!(back.starts_with(&app.url("/auth/callback?")), "{back}");
    let res = browser
        .get(&back)
        .header("cookie", &pre_login)
        .send()
        .await
        .unwrap();
    let cookie = res
        .headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .find(|c| c.starts_with("agentry_session="))
        .unwrap_or_default();
    assert_eq!(location(&res), return_to);
    let (pair, attributes) = cookie.split_once(';').expect("a session cookie");
    (pair.to_owned(), attributes.to_owned(), back)
}

#[tokio::test]
async fn browser_sign_in_sessions_csrf_and_logout() {
    let idp = Idp::start().await;
    let (app, browser) = browser_app(&idp).await;
    idp.set_user(user("carol", &["eng"]));
    let (cookie, attributes, callback) = sign_in(&app, &browser, "/agents/agt_x").await;
    assert!(cookie.starts_with("agentry_session=agt_ses_"), "{cookie}");
    for a in ["HttpOnly", "Secure", "SameSite=Lax", "Path=/"] {
        assert!(attributes.contains(a), "{a} in {attributes}");
    }
    // Only the session's hash is stored.
    let secret = cookie.split_once('=').unwrap().1;
    let dump: Vec<String> =
        sqlx::query_scalar("SELECT encode(session_hash, 'escape') FROM user_sessions")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(dump.len(), 1);
    assert!(!dump[0].contains(secret));

    let with_cookie = |req: reqwest::RequestBuilder| req.header("cookie", &cookie);
    let me = expect_status(
        with_cookie(browser.get(app.url("/v1/me")))
            .send()
            .await
            .unwrap(),
        200,
    )
    .await;
    assert_eq!(me["email"], "carol@example.com");
    assert_eq!(me["teams"][0]["name"], "platform");
    // The sign-in is in the audit log, as the user, for the callback's request.
    let audit = app.get_ok("/v1/audit?action=auth.sign_in").await;
    let entries = audit["items"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{audit}");
    assert_eq!(entries[0]["actor"]["kind"], "user");
    assert_eq!(entries[0]["actor"]["id"], me["id"]);
    assert!(entries[0]["request_id"].is_string(), "{audit}");
    assert!(!audit.to_string().contains("agt_ses_"), "{audit}");

    // The state is used once: replaying the callback fails.
    let res = browser.get(&callback).send().await.unwrap();
    assert_eq!(expect_status(res, 400).await["code"], "sign_in_failed");
    // return_to cannot leave the server.
    let res = browser
        .get(app.url("/auth/login?return_to=//evil.example/x"))
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(res, 422).await["code"], "validation_failed");

    // CSRF: a cookie request that changes state needs this server's origin.
    let body = json!({"name": "from-the-browser"});
    let res = with_cookie(browser.post(app.url("/v1/tokens")))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(res, 403).await["code"], "csrf_rejected");
    let res = with_cookie(browser.post(app.url("/v1/tokens")))
        .header("origin", "http://evil.example")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(res, 403).await["code"], "csrf_rejected");
    let res = with_cookie(browser.post(app.url("/v1/tokens")))
        .header("origin", &app.base)
        .json(&body)
        .send()
        .await
        .unwrap();
    expect_status(res, 201).await;
    // Bearer requests never need it.
    let bot = idp.client_credentials("ci-bot").await;
    let res = browser
        .post(app.url("/v1/tokens"))
        .bearer_auth(&bot)
        .json(&body)
        .send()
        .await
        .unwrap();
    expect_status(res, 201).await;

    // Logout from another origin is refused; from ours it revokes the session.
    let res = with_cookie(browser.post(app.url("/auth/logout")))
        .header("origin", "http://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(res, 403).await["code"], "csrf_rejected");
    let res = with_cookie(browser.post(app.url("/auth/logout")))
        .header("origin", &app.base)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 204);
    assert!(
        res.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
    let res = with_cookie(browser.get(app.url("/v1/me")))
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(res, 401).await["code"], "session_expired");
}

#[tokio::test]
async fn an_idle_session_expires() {
    let idp = Idp::start().await;
    let (app, browser) = browser_app(&idp).await;
    let (cookie, _, _) = sign_in(&app, &browser, "/").await;
    let res = browser
        .get(app.url("/v1/me"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    expect_status(res, 200).await;
    // Time passes beyond the idle limit.
    sqlx::query("UPDATE user_sessions SET idle_expires_at = now() - interval '1 second'")
        .execute(&app.pool)
        .await
        .unwrap();
    let res = browser
        .get(app.url("/v1/me"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(res, 401).await["code"], "session_expired");
    // A forged cookie is no session either.
    let res = browser
        .get(app.url("/v1/me"))
        .header(
            "cookie",
            format!("agentry_session=agt_ses_{}", "0".repeat(64)),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(res, 401).await["code"], "session_expired");
}

#[tokio::test]
async fn without_browser_settings_sign_in_is_not_found() {
    let idp = Idp::start().await;
    let app = app_for(&idp, |_| {}).await;
    for path in ["/auth/login", "/auth/callback?code=c&state=s"] {
        let res = app.client.get(app.url(path)).send().await.unwrap();
        assert_eq!(
            expect_status(res, 404).await["code"],
            "sign_in_not_configured"
        );
    }
}

#[tokio::test]
async fn a_code_from_another_sign_in_is_refused() {
    let idp = Idp::start().await;
    let (app, browser) = browser_app(&idp).await;
    // Two sign-ins started; the provider's answer to the second is delivered with the
    // first's state (a login CSRF / code injection attempt).
    let mut answers = Vec::new();
    let mut cookies = Vec::new();
    for _ in 0..2 {
        let res = browser.get(app.url("/auth/login")).send().await.unwrap();
        cookies.push(login_cookie(&res));
        let res = browser.get(location(&res)).send().await.unwrap();
        answers.push(url::Url::parse(&location(&res)).unwrap());
    }
    let param = |u: &url::Url, name: &str| {
        u.query_pairs()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
            .unwrap()
    };
    let mixed = format!(
        "/auth/callback?code={}&state={}",
        param(&answers[1], "code"),
        param(&answers[0], "state")
    );
    let res = browser
        .get(app.url(&mixed))
        .header("cookie", &cookies[0])
        .send()
        .await
        .unwrap();
    assert!(res.headers().get("set-cookie").is_none());
    assert_eq!(expect_status(res, 400).await["code"], "sign_in_failed");
    // A provider-side refusal is reported, not a session.
    let res = browser
        .get(app.url("/auth/callback?error=access_denied&state=x"))
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(res, 400).await["code"], "sign_in_failed");
}

#[tokio::test]
async fn a_sign_in_finishes_only_in_the_browser_that_started_it() {
    let idp = Idp::start().await;
    let (app, browser) = browser_app(&idp).await;
    // The attacker starts a sign-in of their own and stops at the callback URL…
    idp.set_user(user("mallory", &["eng"]));
    let res = browser.get(app.url("/auth/login")).send().await.unwrap();
    let mallorys = login_cookie(&res);
    let res = browser.get(location(&res)).send().await.unwrap();
    let callback = location(&res);
    // …and has the victim's browser open it: without the pre-login cookie, or with the
    // victim's own from a sign-in of theirs.
    let res = browser.get(app.url("/auth/login")).send().await.unwrap();
    let victims = login_cookie(&res);
    for cookie in [
        None,
        Some(victims.as_str()),
        Some("agentry_login=agt_lgn_forged"),
    ] {
        let mut req = browser.get(&callback);
        if let Some(c) = cookie {
            req = req.header("cookie", c);
        }
        let res = req.send().await.unwrap();
        let session = res
            .headers()
            .get_all("set-cookie")
            .iter()
            .any(|v| v.to_str().unwrap().starts_with("agentry_session="));
        assert!(!session, "no session cookie");
        let status = res.status().as_u16();
        let body: Value = res.json().await.unwrap();
        // The state is used up by the first attempt: the later ones find no sign-in.
        let code = body["code"].as_str().unwrap();
        assert!(
            status == 400 && ["sign_in_browser_mismatch", "sign_in_failed"].contains(&code),
            "{status} {body}"
        );
        if cookie.is_none() {
            assert_eq!(code, "sign_in_browser_mismatch", "{body}");
        }
    }
    // Nobody was signed in: no session, no user from the provider.
    let sessions: i64 = sqlx::query_scalar("SELECT count(*) FROM user_sessions")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(sessions, 0);
    let idp_users: i64 =
        sqlx::query_scalar("SELECT count(*) FROM users WHERE oidc_issuer IS NOT NULL")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(idp_users, 0);
    // The pre-login secret is not stored, only its hash.
    let secret = mallorys.split_once('=').unwrap().1;
    let dump: Vec<String> = sqlx::query_scalar("SELECT row_to_json(l)::text FROM oidc_logins l")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert!(dump.iter().all(|r| !r.contains(secret)), "{dump:?}");
}

#[tokio::test]
async fn sign_ins_in_progress_are_bounded_per_client_address() {
    let idp = Idp::start().await;
    let (app, browser) = browser_app_with(&idp, |s| {
        s.server.trusted_proxies = vec!["127.0.0.1".into()]
    })
    .await;
    let login = |client: &'static str| {
        browser
            .get(app.url("/auth/login"))
            .header("x-forwarded-for", client)
            .send()
    };
    let pending = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM oidc_logins")
            .fetch_one(&app.pool)
            .await
            .unwrap()
    };
    for _ in 0..20 {
        assert_eq!(login("203.0.113.1").await.unwrap().status(), 302);
    }
    let res = login("203.0.113.1").await.unwrap();
    assert_eq!(res.headers()["retry-after"], "60");
    assert!(res.headers().get("set-cookie").is_none());
    assert_eq!(expect_status(res, 429).await["code"], "too_many_requests");
    assert_eq!(pending().await, 20, "the refused sign-in stored nothing");
    // Another client behind the same proxy has its own limit.
    assert_eq!(login("203.0.113.2").await.unwrap().status(), 302);
    // Sign-ins nobody finished expire and are purged.
    sqlx::query("UPDATE oidc_logins SET expires_at = now() - interval '1 second'")
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(login("203.0.113.1").await.unwrap().status(), 302);
    assert_eq!(pending().await, 1);
}

#[tokio::test]
async fn a_team_named_like_a_mapped_team_is_never_adopted() {
    let idp = Idp::start().await;
    let app = app_for(&idp, |_| {}).await;
    // A plain local user, before anyone of the mapped groups signs in.
    let mallory = app
        .post_ok(
            "/v1/users",
            json!({"email": "mallory@example.com", "name": "Mallory"}),
            201,
        )
        .await;
    let mallory_id = mallory["id"].as_str().unwrap();
    let token = app
        .post_ok(
            &format!("/v1/users/{mallory_id}/tokens"),
            json!({"name": "laptop"}),
            201,
        )
        .await;
    let mallory_token = token["token"].as_str().unwrap();
    let res = app
        .client
        .post(app.url("/v1/teams"))
        .bearer_auth(mallory_token)
        .json(&json!({"name": "platform"}))
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(res, 409).await["code"], "team_name_reserved");
    // A team of that name made before the mapping was configured (so the API could not
    // refuse it), with Mallory as its owner.
    let squatted = uuid::Uuid::now_v7();
    sqlx::query("INSERT INTO teams (id, name) VALUES ($1, 'platform')")
        .bind(squatted)
        .execute(&app.pool)
        .await
        .unwrap();
    let mallory_uuid: uuid::Uuid = mallory_id.trim_start_matches("usr_").parse().unwrap();
    sqlx::query("INSERT INTO team_members (team_id, user_id, role) VALUES ($1, $2, 'owner')")
        .bind(squatted)
        .bind(mallory_uuid)
        .execute(&app.pool)
        .await
        .unwrap();

    // Alice of the mapped groups signs in: she joins a team bound to the mapping, made
    // beside Mallory's, and never Mallory's.
    idp.set_user(user("alice", &["eng", "eng-leads"]));
    let tokens = idp.authorization_code("agentry-web").await;
    let alice = tokens["access_token"].as_str().unwrap().to_owned();
    let me = expect_status(get_as(&app, &alice, "/v1/me").await, 200).await;
    let teams = me["teams"].as_array().unwrap();
    assert_eq!(teams.len(), 1, "{me}");
    assert_eq!(teams[0]["name"], "platform-idp", "{me}");
    assert_eq!(teams[0]["role"], "owner");
    let mapped = teams[0]["id"].as_str().unwrap().to_owned();
    assert_ne!(mapped, format!("team_{}", squatted.simple()));
    let members: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT user_id FROM team_members WHERE team_id = $1")
            .bind(squatted)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(members, [mallory_uuid], "nobody joined Mallory's team");
    // Mallory cannot see the mapped team.
    let res = app
        .client
        .get(app.url(&format!("/v1/teams/{mapped}")))
        .bearer_auth(mallory_token)
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(res, 404).await["code"], "not_found");
    // The next sign-in finds the same mapped team by its key.
    let tokens = idp.authorization_code("agentry-web").await;
    let again = get_as(&app, tokens["access_token"].as_str().unwrap(), "/v1/me").await;
    let again = expect_status(again, 200).await;
    assert_eq!(again["teams"][0]["id"], mapped.as_str(), "{again}");
}

#[tokio::test]
async fn unverified_idp_emails_find_nobody() {
    let idp = Idp::start().await;
    let app = app_for(&idp, |_| {}).await;
    let lookup = "/v1/users?email=alice@example.com";
    // No `email_verified` claim: not verified.
    idp.set_user(user("alice", &["eng"]));
    let tokens = idp.authorization_code("agentry-web").await;
    expect_status(
        get_as(&app, tokens["access_token"].as_str().unwrap(), "/v1/me").await,
        200,
    )
    .await;
    assert_eq!(app.get_ok(lookup).await["items"], json!([]));
    // `email_verified: false`: not either.
    let mut claims = user("alice", &["eng"]);
    claims["email_verified"] = json!(false);
    idp.set_user(claims.clone());
    let tokens = idp.authorization_code("agentry-web").await;
    let me = expect_status(
        get_as(&app, tokens["access_token"].as_str().unwrap(), "/v1/me").await,
        200,
    )
    .await;
    assert_eq!(app.get_ok(lookup).await["items"], json!([]));
    // Verified: found.
    claims["email_verified"] = json!(true);
    idp.set_user(claims);
    let tokens = idp.authorization_code("agentry-web").await;
    expect_status(
        get_as(&app, tokens["access_token"].as_str().unwrap(), "/v1/me").await,
        200,
    )
    .await;
    let found = app.get_ok(lookup).await;
    assert_eq!(found["items"][0]["id"], me["id"], "{found}");
}

#[tokio::test]
async fn personal_tokens_of_provider_users_have_a_maximum_lifetime() {
    let idp = Idp::start().await;
    let app = app_for(&idp, |o| o.max_token_days = 30).await;
    idp.set_user(user("alice", &["eng"]));
    let tokens = idp.authorization_code("agentry-web").await;
    let alice = tokens["access_token"].as_str().unwrap();
    let create = |body: Value| {
        app.client
            .post(app.url("/v1/tokens"))
            .bearer_auth(alice)
            .json(&body)
            .send()
    };
    // Longer than the maximum: refused, naming the field, and no token made.
    let res = create(json!({"name": "long", "expires_in_days": 31}))
        .await
        .unwrap();
    let problem = expect_status(res, 422).await;
    assert_eq!(problem["code"], "validation_failed", "{problem}");
    assert!(problem.to_string().contains("expires_in_days"), "{problem}");
    // None asked: the maximum; less asked: as asked.
    let days_left = |t: &Value| {
        let at: chrono::DateTime<chrono::Utc> = t["expires_at"]
            .as_str()
            .expect("an expiry")
            .parse()
            .unwrap();
        (at - chrono::Utc::now()).num_hours()
    };
    let res = create(json!({"name": "default"})).await.unwrap();
    let t = expect_status(res, 201).await;
    assert!((29 * 24..=30 * 24).contains(&days_left(&t)), "{t}");
    let res = create(json!({"name": "short", "expires_in_days": 7}))
        .await
        .unwrap();
    let t = expect_status(res, 201).await;
    assert!((6 * 24..=7 * 24).contains(&days_left(&t)), "{t}");
    let listed = expect_status(get_as(&app, alice, "/v1/tokens").await, 200).await;
    assert_eq!(listed["items"].as_array().unwrap().len(), 2, "{listed}");
    // A local user's token is not bound by it.
    let local = app
        .post_ok(
            "/v1/tokens",
            json!({"name": "admin-long", "expires_in_days": 365}),
            201,
        )
        .await;
    assert!(days_left(&local) > 300 * 24, "{local}");
}

/// Everything an event stream sends until it ends; `None` when still open after `within`.
async fn until_end(res: reqwest::Response, within: Duration) -> Option<String> {
    use futures::StreamExt;
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

#[tokio::test]
async fn a_session_ends_its_streams_when_signed_out_and_at_the_provider_recheck() {
    let idp = Idp::start().await;
    let (app, browser) = browser_app_with(&idp, |s| {
        s.events.revalidate_s = 1;
        if let Some(o) = s.auth.oidc.as_mut() {
            o.session_recheck_s = 3;
        }
    })
    .await;
    let open = |cookie: String| {
        browser
            .get(app.url("/v1/events"))
            .header("cookie", cookie)
            .send()
    };
    // Signed out elsewhere (another tab): the open stream ends at once.
    let (cookie, _, _) = sign_in(&app, &browser, "/").await;
    let stream = open(cookie.clone()).await.unwrap();
    assert_eq!(stream.status(), 200);
    sqlx::query("UPDATE user_sessions SET revoked_at = now()")
        .execute(&app.pool)
        .await
        .unwrap();
    let text = until_end(stream, Duration::from_secs(3))
        .await
        .expect("the stream ended");
    assert!(text.contains(": ended session_expired"), "{text}");

    // Past the recheck period, the session (and its stream) ends: sign in again.
    idp.set_user(user("alice", &["eng"]));
    let (cookie, _, _) = sign_in(&app, &browser, "/").await;
    let me = |cookie: String| {
        browser
            .get(app.url("/v1/me"))
            .header("cookie", cookie)
            .send()
    };
    let before = expect_status(me(cookie.clone()).await.unwrap(), 200).await;
    assert_eq!(before["teams"].as_array().unwrap().len(), 1, "{before}");
    let stream = open(cookie.clone()).await.unwrap();
    assert_eq!(stream.status(), 200);
    // Meanwhile the provider drops the group.
    idp.set_user(user("alice", &[]));
    let text = until_end(stream, Duration::from_secs(8))
        .await
        .expect("the stream ended at the recheck");
    assert!(text.contains(": ended session_expired"), "{text}");
    let res = open(cookie).await.unwrap();
    assert_eq!(expect_status(res, 401).await["code"], "session_expired");
    // Signed in again, the user's teams are what the provider says now.
    let (cookie, _, _) = sign_in(&app, &browser, "/").await;
    let after = expect_status(me(cookie).await.unwrap(), 200).await;
    assert_eq!(after["teams"], json!([]), "{after}");
}
