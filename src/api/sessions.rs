//! Browser sign-in (outside `/v1`): `GET /auth/login` sends the browser to the identity
//! provider with a short-lived pre-login cookie (`agentry_login`), `GET /auth/callback`
//! turns its answer into a session cookie when the browser brings that pre-login cookie
//! back, `POST /auth/logout` revokes the session. The session cookie is `HttpOnly;
//! Secure; SameSite=Lax; Path=/`. Cookie-authenticated requests that change state must
//! come from this server's origin (see `check_origin`).

use actix_web::http::{Method, StatusCode, header};
use actix_web::{HttpMessage, HttpRequest, HttpResponse, get, post, web};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiError, ApiResult, Problem};
use super::middleware::RequestId;
use crate::api::AppState;
use crate::auth::AuthError;
use crate::auth::oidc::browser::{LOGIN_COOKIE, SESSION_COOKIE, SignInError};
use crate::services::sessions;

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(login).service(callback).service(logout);
}

impl From<SignInError> for ApiError {
    fn from(e: SignInError) -> Self {
        match e {
            SignInError::NotConfigured => ApiError::new(
                StatusCode::NOT_FOUND,
                "sign_in_not_configured",
                e.to_string(),
            ),
            SignInError::BadReturnTo => ApiError::validation("return_to", e.to_string()),
            SignInError::Failed(m) => ApiError::bad_request("sign_in_failed", m),
            SignInError::OtherBrowser => {
                ApiError::bad_request("sign_in_browser_mismatch", e.to_string())
            }
            SignInError::TooMany(m) => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_requests", m)
            }
            SignInError::Auth(a) => a.into(),
        }
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct LoginQuery {
    /// A path on this server to return to after signing in (default `/`).
    return_to: Option<String>,
}

/// Start browser sign-in: a redirect to the identity provider (authorization code flow
/// with PKCE), with a pre-login cookie that binds the sign-in to this browser. At most
/// 20 sign-ins started and not finished per client address and minute.
#[utoipa::path(tag = "auth", params(LoginQuery), responses(
    (status = 302, description = "To the identity provider's sign-in page",
        headers(("Location" = String, description = "The provider's authorization URL"),
            ("Set-Cookie" = String, description = "agentry_login=…; HttpOnly; SameSite=Lax; Path=/auth; Max-Age=600 (and Secure when the redirect URL is https)"))),
    (status = 400, body = Problem, description = "The query does not parse"),
    (status = 404, body = Problem, description = "Browser sign-in is not configured"),
    (status = 422, body = Problem, description = "return_to is not a path on this server"),
    (status = 429, body = Problem, description = "Too many sign-ins in progress (code `too_many_requests`; see Retry-After)",
        headers(("Retry-After" = u32, description = "Seconds to wait"))),
    (status = 500, body = Problem, description = "An unexpected failure"),
    (status = 503, body = Problem, description = "The identity provider or the database is not reachable yet")))]
#[get("/auth/login")]
async fn login(
    state: web::Data<AppState>,
    req: HttpRequest,
    q: web::Query<LoginQuery>,
) -> ApiResult<HttpResponse> {
    let client = super::client_addr::rate_limit_key(&req);
    let started = match sessions::login_url(
        &state.services.data,
        &state.services.access,
        q.return_to.as_deref(),
        &client,
    )
    .await
    {
        Ok(s) => s,
        Err(e @ SignInError::TooMany(_)) => {
            let mut res = actix_web::ResponseError::error_response(&ApiError::from(e));
            res.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(60));
            return Ok(res);
        }
        Err(e) => return Err(e.into()),
    };
    let secure = if https_redirect(&state) {
        "; Secure"
    } else {
        ""
    };
    Ok(HttpResponse::Found()
        .insert_header((header::LOCATION, started.url))
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .insert_header((
            header::SET_COOKIE,
            format!(
                "{LOGIN_COOKIE}={}; HttpOnly; SameSite=Lax; Path=/auth; Max-Age={}{secure}",
                started.browser, started.max_age_s
            ),
        ))
        .finish())
}

/// The redirect URL (this server, as the provider sends browsers back) is https.
fn https_redirect(state: &AppState) -> bool {
    state
        .settings
        .auth
        .oidc
        .as_ref()
        .and_then(|o| o.redirect_url.as_deref())
        .is_some_and(|u| u.starts_with("https://"))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct CallbackQuery {
    /// The authorization code from the provider.
    code: Option<String>,
    /// The state this server sent with the sign-in.
    state: Option<String>,
    /// Set by the provider when the sign-in failed there.
    error: Option<String>,
}

/// Where the identity provider sends the browser back: the browser must bring the
/// pre-login cookie of `GET /auth/login` (else 400 `sign_in_browser_mismatch`, nobody
/// signed in), then the code is exchanged, the ID token checked, a session opened
/// (cookie), and the browser sent to `return_to`.
#[utoipa::path(tag = "auth", params(CallbackQuery), responses(
    (status = 302, description = "Signed in: the session cookie is set",
        headers(("Location" = String, description = "The return_to path"),
            ("Set-Cookie" = String, description = "agentry_session=…; HttpOnly; Secure; SameSite=Lax; Path=/"))),
    (status = 400, body = Problem, description = "The sign-in failed (code `sign_in_failed`), or was started in another browser (`sign_in_browser_mismatch`)"),
    (status = 401, body = Problem, description = "The provider's ID token is not valid"),
    (status = 404, body = Problem, description = "Browser sign-in is not configured"),
    (status = 500, body = Problem, description = "An unexpected failure"),
    (status = 503, body = Problem, description = "The identity provider or the database is not reachable")))]
#[get("/auth/callback")]
async fn callback(
    state: web::Data<AppState>,
    req: HttpRequest,
    q: web::Query<CallbackQuery>,
) -> ApiResult<HttpResponse> {
    let ctx = &state.services;
    if ctx.access.oidc.is_none() {
        return Err(SignInError::NotConfigured.into());
    }
    if let Some(err) = &q.error {
        let shown: String = err
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
            .take(64)
            .collect();
        return Err(ApiError::bad_request(
            "sign_in_failed",
            format!("the identity provider refused the sign-in ({shown})"),
        ));
    }
    let (Some(code), Some(st)) = (&q.code, &q.state) else {
        return Err(ApiError::bad_request(
            "sign_in_failed",
            "the provider's answer has no code or state",
        ));
    };
    let request_id = req.extensions().get::<RequestId>().map(|r| r.0.clone());
    let browser = cookie(&req, LOGIN_COOKIE);
    let signed = sessions::finish_sign_in(
        &ctx.data,
        &ctx.access,
        code,
        st,
        browser.as_deref(),
        request_id.as_deref(),
    )
    .await?;
    Ok(HttpResponse::Found()
        .insert_header((header::LOCATION, signed.return_to))
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .insert_header((
            header::SET_COOKIE,
            format!(
                "{SESSION_COOKIE}={}; HttpOnly; Secure; SameSite=Lax; Path=/; Max-Age={}",
                signed.session, signed.max_age_s
            ),
        ))
        // The pre-login cookie has done its work.
        .append_header((
            header::SET_COOKIE,
            format!("{LOGIN_COOKIE}=; HttpOnly; SameSite=Lax; Path=/auth; Max-Age=0"),
        ))
        .finish())
}

/// Sign out: the session is revoked and the cookie cleared. Like every cookie request
/// that changes state, it must come from this server's origin.
#[utoipa::path(tag = "auth", responses(
    (status = 204, description = "Signed out (also when there was no session)"),
    (status = 403, body = Problem, description = "Another origin (code `csrf_rejected`)"),
    (status = 500, body = Problem, description = "An unexpected failure"),
    (status = 503, body = Problem, description = "The database is unavailable")))]
#[post("/auth/logout")]
async fn logout(state: web::Data<AppState>, req: HttpRequest) -> ApiResult<HttpResponse> {
    let ctx = &state.services;
    if let Some(cookie) = session_cookie(&req) {
        check_origin(&state, &req)?;
        sessions::sign_out(&ctx.data, &cookie).await?;
    }
    Ok(HttpResponse::NoContent()
        .insert_header((
            header::SET_COOKIE,
            format!("{SESSION_COOKIE}=; HttpOnly; Secure; SameSite=Lax; Path=/; Max-Age=0"),
        ))
        .finish())
}

/// The session cookie's value, when the request carries one.
pub(super) fn session_cookie(req: &HttpRequest) -> Option<String> {
    cookie(req, SESSION_COOKIE)
}

/// The value of the cookie `name`, when the request carries one.
fn cookie(req: &HttpRequest, name: &str) -> Option<String> {
    req.headers()
        .get_all(header::COOKIE)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, value)| value.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// Requests that only read never change state; the others need the origin check.
pub(super) fn changes_state(req: &HttpRequest) -> bool {
    !matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS)
}

/// CSRF defence for cookie-authenticated requests that change state: the `Origin`
/// header (or, when a browser sends none, the `Referer`) must be this server's origin —
/// the scheme, host and port of `auth.oidc.redirect_url`. Bearer requests never need it.
pub(super) fn check_origin(state: &AppState, req: &HttpRequest) -> Result<(), AuthError> {
    let ours = state
        .settings
        .auth
        .oidc
        .as_ref()
        .and_then(|o| o.redirect_url.as_deref())
        .and_then(|u| url::Url::parse(u).ok())
        .map(|u| u.origin().ascii_serialization());
    let Some(ours) = ours else {
        return Err(AuthError::CsrfRejected(
            "browser sessions are not configured on this server",
        ));
    };
    let header_text = |name| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let theirs = match header_text(header::ORIGIN) {
        Some(o) => Some(o),
        None => header_text(header::REFERER)
            .and_then(|r| url::Url::parse(&r).ok())
            .map(|u| u.origin().ascii_serialization()),
    };
    match theirs {
        Some(o) if o == ours => Ok(()),
        Some(_) => Err(AuthError::CsrfRejected(
            "this request comes from another origin; a browser session only acts for pages of this server",
        )),
        None => Err(AuthError::CsrfRejected(
            "a browser request that changes something must carry an Origin header",
        )),
    }
}
