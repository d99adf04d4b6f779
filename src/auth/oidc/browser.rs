//! Browser sign-in: the authorization code flow with PKCE (S256) against the provider,
//! and the server-side sessions it ends in. The `state`, the PKCE verifier and the
//! `nonce` of a sign-in in progress are kept in the database (by the state's hash) for
//! ten minutes and used once. A sign-in is bound to the browser that started it: `begin`
//! hands out a random pre-login secret for a short-lived cookie (`LOGIN_COOKIE`), only
//! its hash is kept with the state, and `finish` signs nobody in unless the callback
//! brings the same secret (login CSRF: nobody can finish their own sign-in in someone
//! else's browser). Sign-ins in progress are bounded: at most `LOGINS_PER_MINUTE` started
//! and not finished per client address, at most `MAX_PENDING_LOGINS` in all; expired ones
//! are purged. A session is a random secret in a cookie; only its SHA-256 is stored, with
//! an idle and an absolute expiry; signing out revokes it.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{Duration, Utc};
use rand::RngCore;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::users::principal_of;
use super::{IdpIdentity, Oidc, principal_for};
use crate::auth::{AuthError, Principal};
use crate::store::{self, DeadlinePool};

/// The name of the session cookie.
pub const SESSION_COOKIE: &str = "agentry_session";
const SESSION_PREFIX: &str = "agt_ses_";
/// The name of the pre-login cookie that binds a sign-in to its browser.
pub const LOGIN_COOKIE: &str = "agentry_login";
const LOGIN_PREFIX: &str = "agt_lgn_";
/// Minutes a sign-in in progress (and its pre-login cookie) lives.
pub const LOGIN_TTL_MINUTES: i64 = 10;
/// Sign-ins one client address may start (and not finish) per minute.
pub const LOGINS_PER_MINUTE: i64 = 20;
/// Sign-ins in progress at most, from every address together.
pub const MAX_PENDING_LOGINS: i64 = 10_000;

/// Why a sign-in could not start or finish.
#[derive(Debug, thiserror::Error)]
pub enum SignInError {
    #[error("browser sign-in is not configured (set auth.oidc.client_id and redirect_url)")]
    NotConfigured,
    #[error("return_to must be a path on this server, like /agents/agt_…")]
    BadReturnTo,
    #[error("{0}")]
    Failed(String),
    /// The callback did not bring the pre-login cookie of the browser that started it.
    #[error("this sign-in was started in another browser (or its cookie expired); start again")]
    OtherBrowser,
    /// Too many sign-ins in progress, from this address or in all.
    #[error("{0}")]
    TooMany(&'static str),
    #[error(transparent)]
    Auth(#[from] AuthError),
}

impl From<sqlx::Error> for SignInError {
    fn from(e: sqlx::Error) -> Self {
        SignInError::Auth(AuthError::Store(e))
    }
}

fn random_b64(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut b);
    URL_SAFE_NO_PAD.encode(b)
}

fn hash(s: &str) -> Vec<u8> {
    Sha256::digest(s.as_bytes()).to_vec()
}

/// A same-origin path: starts with one `/`, no scheme or host can hide in it.
pub fn valid_return_to(p: &str) -> bool {
    p.starts_with('/')
        && !p.starts_with("//")
        && !p.contains('\\')
        && p.len() <= 2048
        && p.bytes().all(|b| b.is_ascii_graphic())
}

/// A sign-in started: where to send the browser, and the pre-login secret to set as its
/// `LOGIN_COOKIE` for `max_age_s` seconds.
pub struct Started {
    pub url: String,
    pub browser: String,
    pub max_age_s: i64,
}

/// Start a sign-in for a browser at `client_addr`: remember state, verifier, nonce and
/// the hash of a new pre-login secret.
pub async fn begin(
    idp: &Oidc,
    pool: &DeadlinePool,
    return_to: Option<&str>,
    client_addr: &str,
) -> Result<Started, SignInError> {
    let s = idp.settings();
    let (Some(client_id), Some(redirect_url)) = (&s.client_id, &s.redirect_url) else {
        return Err(SignInError::NotConfigured);
    };
    let return_to = return_to.unwrap_or("/");
    if !valid_return_to(return_to) {
        return Err(SignInError::BadReturnTo);
    }
    let meta = idp.metadata().ok_or_else(|| {
        AuthError::IdpUnavailable("the identity provider is not reachable yet".into())
    })?;
    let endpoint = meta.authorization_endpoint.as_deref().ok_or_else(|| {
        SignInError::Failed(
            "the provider's discovery document has no authorization_endpoint".into(),
        )
    })?;
    let (pending, from_here) =
        store::oidc::count_logins(pool, client_addr, Utc::now() - Duration::minutes(1)).await?;
    if from_here >= LOGINS_PER_MINUTE {
        return Err(SignInError::TooMany(
            "too many sign-ins started from this address; retry in a minute",
        ));
    }
    if pending >= MAX_PENDING_LOGINS {
        return Err(SignInError::TooMany(
            "too many sign-ins are in progress on this server; retry in a minute",
        ));
    }
    let state = random_b64(32);
    let nonce = random_b64(32);
    let verifier = random_b64(32);
    let browser = format!("{LOGIN_PREFIX}{}", random_b64(32));
    let challenge = URL_SAFE_NO_PAD.encode(Sha256::digest(verifier.as_bytes()));
    store::oidc::insert_login(
        pool,
        &hash(&state),
        &hash(&browser),
        client_addr,
        &verifier,
        &nonce,
        return_to,
        Utc::now() + Duration::minutes(LOGIN_TTL_MINUTES),
    )
    .await?;
    let url = url::Url::parse_with_params(
        endpoint,
        &[
            ("response_type", "code"),
            ("client_id", client_id.as_str()),
            ("redirect_uri", redirect_url.as_str()),
            ("scope", s.scopes.as_str()),
            ("state", state.as_str()),
            ("nonce", nonce.as_str()),
            ("code_challenge", challenge.as_str()),
            ("code_challenge_method", "S256"),
        ],
    )
    .map_err(|e| SignInError::Failed(format!("the authorization_endpoint is not a URL: {e}")))?;
    Ok(Started {
        url: url.into(),
        browser,
        max_age_s: LOGIN_TTL_MINUTES * 60,
    })
}

/// A finished sign-in: the session secret for the cookie, where to go, and who.
pub struct SignedIn {
    pub session: String,
    pub return_to: String,
    pub principal: Principal,
    /// Seconds until the session ends at the latest (the cookie's Max-Age).
    pub max_age_s: u64,
}

#[derive(Deserialize)]
struct TokenResponse {
    id_token: Option<String>,
}

/// Finish a sign-in in the browser whose pre-login cookie is `browser`: exchange the code
/// (with the PKCE verifier), validate the ID token and its nonce, upsert the user and
/// open a session. Without the cookie of the browser that started it, nobody is signed
/// in (the state is used up all the same).
pub async fn finish(
    idp: &Oidc,
    pool: &DeadlinePool,
    code: &str,
    state: &str,
    browser: Option<&str>,
) -> Result<SignedIn, SignInError> {
    let s = idp.settings();
    let (Some(client_id), Some(redirect_url)) = (&s.client_id, &s.redirect_url) else {
        return Err(SignInError::NotConfigured);
    };
    let login = store::oidc::take_login(pool, &hash(state))
        .await?
        .filter(|l| l.expires_at > Utc::now())
        .ok_or_else(|| {
            SignInError::Failed("this sign-in is unknown, used or expired; start again".into())
        })?;
    let same_browser = browser
        .filter(|b| b.starts_with(LOGIN_PREFIX) && b.len() <= 200)
        .is_some_and(|b| constant_time_eq(&hash(b), &login.browser_hash));
    if !same_browser {
        return Err(SignInError::OtherBrowser);
    }
    let meta = idp.metadata().ok_or_else(|| {
        AuthError::IdpUnavailable("the identity provider is not reachable yet".into())
    })?;
    let endpoint = meta.token_endpoint.as_deref().ok_or_else(|| {
        SignInError::Failed("the provider's discovery document has no token_endpoint".into())
    })?;
    let mut form = vec![
        ("grant_type", "authorization_code"),
        ("code", code),
        ("redirect_uri", redirect_url.as_str()),
        ("code_verifier", login.code_verifier.as_str()),
    ];
    let mut req = idp.http().post(endpoint);
    match &s.client_secret {
        Some(secret) => req = req.basic_auth(client_id, Some(secret.expose())),
        None => form.push(("client_id", client_id.as_str())),
    }
    let res = req.form(&form).send().await.map_err(|e| {
        SignInError::Failed(format!("the provider's token endpoint is unreachable: {e}"))
    })?;
    if !res.status().is_success() {
        return Err(SignInError::Failed(format!(
            "the provider refused the code exchange ({})",
            res.status()
        )));
    }
    let tokens: TokenResponse = res
        .json()
        .await
        .map_err(|_| SignInError::Failed("the provider's token answer is not JSON".into()))?;
    let id_token = tokens
        .id_token
        .ok_or_else(|| SignInError::Failed("the provider sent no ID token".into()))?;
    let claims = idp
        .validate(&id_token, std::slice::from_ref(client_id))
        .await?;
    // With several audiences, the ID token must have been issued to us (`azp`).
    let azp = claims.get("azp").and_then(|v| v.as_str());
    if azp.is_some_and(|a| a != client_id) {
        return Err(SignInError::Failed(
            "the ID token was issued to another client (azp)".into(),
        ));
    }
    if claims.get("nonce").and_then(|v| v.as_str()) != Some(login.nonce.as_str()) {
        return Err(SignInError::Failed(
            "the ID token's nonce does not match this sign-in".into(),
        ));
    }
    let who = IdpIdentity::from_claims(&claims, s)?;
    let principal = principal_for(pool, s, &who).await?;
    let mut secret = [0u8; 32];
    rand::rng().fill_bytes(&mut secret);
    let session = format!("{SESSION_PREFIX}{}", hex::encode(secret));
    let now = Utc::now();
    store::oidc::insert_session(
        pool,
        principal.user_id,
        &hash(&session),
        &who.groups,
        now + seconds(s.session_idle_s),
        now + seconds(s.session_absolute_s),
    )
    .await?;
    Ok(SignedIn {
        session,
        return_to: login.return_to,
        principal,
        max_age_s: s.session_absolute_s,
    })
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn seconds(s: u64) -> Duration {
    Duration::seconds(s.min(i64::MAX as u64 / 1000) as i64)
}

/// The caller of a session cookie. Unknown, revoked and expired sessions are all
/// `session_expired`; the group mapping is applied again from the groups of sign-in.
pub async fn authenticate_session(
    idp: &Oidc,
    pool: &DeadlinePool,
    cookie: &str,
) -> Result<Principal, AuthError> {
    if !cookie.starts_with(SESSION_PREFIX) || cookie.len() > 200 {
        return Err(AuthError::SessionExpired);
    }
    let row = store::oidc::session_by_hash(pool, &hash(cookie))
        .await?
        .ok_or(AuthError::SessionExpired)?;
    let now = Utc::now();
    if row.revoked_at.is_some() || row.idle_expires_at <= now || row.absolute_expires_at <= now {
        return Err(AuthError::SessionExpired);
    }
    // Past `session_recheck_s` the provider must vouch for the user again: a new sign-in.
    if row.created_at + seconds(idp.settings().session_recheck_s) <= now {
        return Err(AuthError::SessionExpired);
    }
    let user = store::identity::get_user(pool, row.user_id)
        .await?
        .ok_or(AuthError::SessionExpired)?;
    store::oidc::touch_session(
        pool,
        row.id,
        seconds(idp.settings().session_idle_s).num_seconds(),
    )
    .await?;
    principal_of(pool, idp.settings(), user, &row.groups).await
}

/// Sign out: revoke the session of this cookie (if it is one).
pub async fn sign_out(pool: &DeadlinePool, cookie: &str) -> Result<bool, AuthError> {
    Ok(store::oidc::revoke_session(pool, &hash(cookie)).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn return_to_stays_on_this_server() {
        for ok in ["/", "/agents/agt_1", "/workspaces/w?tab=diff"] {
            assert!(valid_return_to(ok), "{ok}");
        }
        for bad in [
            "//evil.example",
            "https://evil.example/",
            "/\\evil.example",
            "evil",
            "",
            "/a b",
        ] {
            assert!(!valid_return_to(bad), "{bad}");
        }
    }
}
