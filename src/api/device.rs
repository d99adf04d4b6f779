//! Device sign-in (RFC 8628) for clients without a browser, such as `agentry login`.
//! Two routes need no credentials, like the browser sign-in routes beside them (outside
//! `/v1`, where every route is authenticated): `POST /auth/device` hands out a code pair,
//! `POST /auth/device/token` is polled with the device code until the person answers.
//! The person, signed in to the dashboard (its `/device` page), looks the request up
//! and approves or denies it through `/v1/auth/device…`. See `services::device`.

use actix_web::http::{StatusCode, header};
use actix_web::{HttpMessage, HttpRequest, HttpResponse, ResponseError, get, post, web};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiError, ApiResult, Problem};
use super::middleware::RequestId;
use crate::api::AppState;
use crate::auth::Principal;
use crate::services::device::{
    self, AnswerDevice, DeviceAuthorization, DeviceError, DeviceRequest, DeviceToken,
    DeviceTokenRequest, StartDevice,
};

/// The routes that need no credentials (outside `/v1`).
pub fn configure_public(cfg: &mut ServiceConfig) {
    cfg.service(start_device_sign_in)
        .service(collect_device_token);
}

/// The approver's routes (inside `/v1`).
pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(describe_device_request)
        .service(approve_device)
        .service(deny_device);
}

impl From<DeviceError> for ApiError {
    fn from(e: DeviceError) -> Self {
        let status = match &e {
            DeviceError::Service(_) => match e {
                DeviceError::Service(s) => return s.into(),
                _ => unreachable!("matched above"),
            },
            DeviceError::AuthorizationPending
            | DeviceError::SlowDown(_)
            | DeviceError::ExpiredToken
            | DeviceError::AccessDenied => StatusCode::BAD_REQUEST,
            DeviceError::AlreadyAnswered => StatusCode::CONFLICT,
            DeviceError::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
        };
        ApiError::new(status, e.code(), e.to_string())
    }
}

/// A refusal as a response; a rate limit says when to come back.
fn refusal(e: DeviceError) -> HttpResponse {
    let retry_after = match &e {
        DeviceError::TooManyRequests => Some(60),
        DeviceError::SlowDown(s) => Some(*s),
        _ => None,
    };
    let mut res = ApiError::from(e).error_response();
    if let Some(s) = retry_after {
        res.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from(s));
    }
    res.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    res
}

/// Start a device sign-in: a device code for the client (secret, polled with) and a
/// user code for its person, who approves it on the dashboard's `/device` page. Both
/// expire in ten minutes. At most ten code pairs per minute from one address.
#[utoipa::path(tag = "auth", request_body = StartDevice, responses(
    (status = 200, body = DeviceAuthorization),
    (status = 400, body = Problem, description = "The body does not parse"),
    (status = 413, body = Problem, description = "The body is too large"),
    (status = 415, body = Problem, description = "The body is not JSON"),
    (status = 422, body = Problem, description = "client_name is not acceptable"),
    (status = 429, body = Problem, description = "Too many code pairs from this address (code `too_many_requests`; see Retry-After)",
        headers(("Retry-After" = u32, description = "Seconds to wait"))),
    (status = 500, body = Problem, description = "An unexpected failure"),
    (status = 503, body = Problem, description = "The database is unavailable")))]
#[post("/auth/device")]
async fn start_device_sign_in(
    state: web::Data<AppState>,
    req: HttpRequest,
    body: web::Json<StartDevice>,
) -> ApiResult<HttpResponse> {
    let info = req.connection_info().clone();
    // Behind trusted proxies, the client they name; else the TCP peer (an IPv6 one by
    // its /64).
    let client_ip = super::client_addr::rate_limit_key(&req);
    let page = format!("{}://{}/device", info.scheme(), info.host());
    match device::start(&state.services.data, &body, &client_ip, &page).await {
        Ok(codes) => Ok(HttpResponse::Ok()
            .insert_header((header::CACHE_CONTROL, "no-store"))
            .json(codes)),
        Err(e) => Ok(refusal(e)),
    }
}

/// Poll for the token with the device code, every `interval` seconds. Until the person
/// answers: 400 `authorization_pending` (or `slow_down` when polled too fast); then the
/// new token once (a personal token of the approver, named after the client), or 400
/// `access_denied`; after ten minutes 400 `expired_token`. A code already used, or one
/// this server never issued: 404.
#[utoipa::path(tag = "auth", request_body = DeviceTokenRequest, responses(
    (status = 200, body = DeviceToken),
    (status = 400, body = Problem, description = "Not yet (`authorization_pending`, `slow_down`), `access_denied` or `expired_token`; or the body does not parse"),
    (status = 404, body = Problem, description = "Unknown or already used device code"),
    (status = 413, body = Problem, description = "The body is too large"),
    (status = 415, body = Problem, description = "The body is not JSON"),
    (status = 422, body = Problem, description = "A field is not acceptable"),
    (status = 500, body = Problem, description = "An unexpected failure"),
    (status = 503, body = Problem, description = "The database is unavailable")))]
#[post("/auth/device/token")]
async fn collect_device_token(
    state: web::Data<AppState>,
    req: HttpRequest,
    body: web::Json<DeviceTokenRequest>,
) -> ApiResult<HttpResponse> {
    let request_id = req.extensions().get::<RequestId>().map(|r| r.0.clone());
    match device::collect(&state.services.data, &body, request_id.as_deref()).await {
        Ok(t) => Ok(HttpResponse::Ok()
            .insert_header((header::CACHE_CONTROL, "no-store"))
            .json(t)),
        Err(e) => Ok(refusal(e)),
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct CodeQuery {
    /// The code the client shows.
    user_code: String,
}

/// A device sign-in request as its approver sees it: which client asks, and whether it
/// is still pending. Unknown or used codes: 404; expired: 400 `expired_token`.
#[utoipa::path(tag = "auth", security(("bearer" = [])), params(CodeQuery), responses(
    (status = 200, body = DeviceRequest),
    (status = 400, body = Problem, description = "The code expired (`expired_token`)"),
    (status = 404, body = Problem, description = "No pending sign-in has this user code")))]
#[get("/auth/device")]
async fn describe_device_request(
    state: web::Data<AppState>,
    principal: Principal,
    q: web::Query<CodeQuery>,
) -> ApiResult<web::Json<DeviceRequest>> {
    Ok(web::Json(
        device::describe(&state.services.data, &principal, &q.user_code).await?,
    ))
}

/// Approve a device sign-in: the client's next poll gets a new personal token of yours
/// (with no more scopes than the token you approve with), named after the client.
#[utoipa::path(tag = "auth", security(("bearer" = [])), request_body = AnswerDevice, responses(
    (status = 200, body = DeviceRequest),
    (status = 400, body = Problem, description = "The code expired (`expired_token`)"),
    (status = 404, body = Problem, description = "No pending sign-in has this user code"),
    (status = 409, body = Problem, description = "Already approved or denied (`device_code_answered`)")))]
#[post("/auth/device/approve")]
async fn approve_device(
    state: web::Data<AppState>,
    principal: Principal,
    body: web::Json<AnswerDevice>,
) -> ApiResult<web::Json<DeviceRequest>> {
    Ok(web::Json(
        device::answer(&state.services.data, &principal, &body, true).await?,
    ))
}

/// Deny a device sign-in: the client's next poll gets 400 `access_denied`.
#[utoipa::path(tag = "auth", security(("bearer" = [])), request_body = AnswerDevice, responses(
    (status = 200, body = DeviceRequest),
    (status = 400, body = Problem, description = "The code expired (`expired_token`)"),
    (status = 404, body = Problem, description = "No pending sign-in has this user code"),
    (status = 409, body = Problem, description = "Already approved or denied (`device_code_answered`)")))]
#[post("/auth/device/deny")]
async fn deny_device(
    state: web::Data<AppState>,
    principal: Principal,
    body: web::Json<AnswerDevice>,
) -> ApiResult<web::Json<DeviceRequest>> {
    Ok(web::Json(
        device::answer(&state.services.data, &principal, &body, false).await?,
    ))
}
