//! The `Principal` extractor: reads `Authorization: Bearer <token>` and asks `auth` who
//! it is; without that header, a browser session cookie (`agentry_session`) is accepted,
//! and a cookie request that changes state must pass the origin check (CSRF). A handler
//! that takes a `Principal` cannot run unauthenticated.

use std::future::Future;
use std::pin::Pin;

use actix_web::{FromRequest, HttpRequest, dev::Payload, http::header, web};

use super::error::ApiError;
use super::sessions;
use crate::auth::{self, AuthError, Principal};
use crate::server::AppState;

const MAX_TOKEN_BYTES: usize = 16 * 1024;

impl FromRequest for Principal {
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Result<Self, Self::Error>>>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let state = req.app_data::<web::Data<AppState>>().cloned();
        let header = req
            .headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes().to_vec());
        let req = req.clone();
        Box::pin(async move {
            let state =
                state.ok_or_else(|| ApiError::internal(anyhow::anyhow!("app state missing")))?;
            let ctx = &state.services;
            let Some(raw) = header else {
                return match sessions::session_cookie(&req) {
                    Some(cookie) if ctx.oidc.is_some() => {
                        if sessions::changes_state(&req) {
                            sessions::check_origin(&state, &req)?;
                        }
                        Ok(crate::services::sessions::session_principal(ctx, &cookie).await?)
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
            Ok(auth::authenticate(&ctx.pool, &ctx.runtime, ctx.oidc.as_ref(), token).await?)
        })
    }
}
