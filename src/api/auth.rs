//! The `Principal` extractor. Requests to `/v1` routes are authenticated by
//! `access::enforce` (which also checks the route's token scope) and the extractor hands
//! out that principal; a `/v1` handler whose route has no declared access refuses to
//! run. `authenticate_request` reads `Authorization: Bearer <token>` and asks `auth` who
//! it is; without that header, a browser session cookie (`agentry_session`) is accepted,
//! and a cookie request that changes state must pass the origin check (CSRF).

use std::future::Future;
use std::pin::Pin;

use actix_web::{FromRequest, HttpMessage, HttpRequest, dev::Payload, http::header, web};

use super::error::ApiError;
use super::middleware::RequestId;
use super::sessions;
use crate::api::AppState;
use crate::auth::{self, AuthError, Principal};

const MAX_TOKEN_BYTES: usize = 16 * 1024;

impl FromRequest for Principal {
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Result<Self, Self::Error>>>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        if let Some(principal) = req.extensions().get::<Principal>() {
            let principal = principal.clone();
            return Box::pin(async move { Ok(principal) });
        }
        if req.path().starts_with("/v1/") {
            let route = format!(
                "{} {}",
                req.method(),
                super::middleware::route_pattern(req).unwrap_or_default()
            );
            return Box::pin(async move {
                Err(ApiError::internal(anyhow::anyhow!(
                    "route {route} has no access policy in api::access::ROUTES"
                )))
            });
        }
        Box::pin(authenticate_request(req))
    }
}

/// Who sent `req`: its bearer token resolved to a principal, carrying the request's id.
pub fn authenticate_request(
    req: &HttpRequest,
) -> impl Future<Output = Result<Principal, ApiError>> + 'static {
    let state = req.app_data::<web::Data<AppState>>().cloned();
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes().to_vec());
    let request_id = req.extensions().get::<RequestId>().map(|r| r.0.clone());
    let req = req.clone();
    async move {
        let state =
            state.ok_or_else(|| ApiError::internal(anyhow::anyhow!("app state missing")))?;
        let ctx = &state.services;
        let Some(raw) = header else {
            return match sessions::session_cookie(&req) {
                Some(cookie) if ctx.access.oidc.is_some() => {
                    if sessions::changes_state(&req) {
                        sessions::check_origin(&state, &req)?;
                    }
                    let mut principal = crate::services::sessions::session_principal(
                        &ctx.data,
                        &ctx.access,
                        &cookie,
                    )
                    .await?;
                    principal.request_id = request_id;
                    Ok(principal)
                }
                _ => Err(AuthError::TokenMissing.into()),
            };
        };
        if raw.len() > MAX_TOKEN_BYTES + 7 {
            return Err(AuthError::TokenTooLarge.into());
        }
        let raw = std::str::from_utf8(&raw)
            .map_err(|_| AuthError::TokenMalformed("the Authorization header is not text"))?;
        let token = raw
            .strip_prefix("Bearer ")
            .or_else(|| raw.strip_prefix("bearer "))
            .map(str::trim)
            .ok_or(AuthError::TokenMalformed(
                "expected `Authorization: Bearer <token>`",
            ))?;
        let mut principal = auth::authenticate(
            &ctx.data.pool,
            &ctx.lifecycle.runtime,
            &ctx.access.tokens,
            ctx.access.oidc.as_ref(),
            token,
        )
        .await?;
        principal.request_id = request_id;
        Ok(principal)
    }
}
