//! `Idempotency-Key` for create requests: the same key from the same principal with the
//! same body returns the original response (200 instead of 201); a different body is 409
//! `idempotency_key_reused`.

use std::future::Future;

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::api::error::{ApiError, ApiResult};
use crate::auth::Principal;
use crate::server::AppState;
use crate::store;

const HEADER: &str = "idempotency-key";

/// Run `create` once per idempotency key and answer with its JSON.
pub async fn respond<B, T, F, Fut>(
    state: &AppState,
    principal: &Principal,
    req: &HttpRequest,
    body: &B,
    create: F,
) -> ApiResult<HttpResponse>
where
    B: Serialize,
    T: Serialize,
    F: FnOnce() -> Fut,
    Fut: Future<Output = ApiResult<(StatusCode, T)>>,
{
    let key = match req.headers().get(HEADER) {
        None => {
            let (status, out) = create().await?;
            return Ok(HttpResponse::build(status).json(out));
        }
        Some(v) => v
            .to_str()
            .ok()
            .filter(|k| !k.is_empty() && k.len() <= 255)
            .ok_or_else(|| {
                ApiError::bad_request(
                    "invalid_idempotency_key",
                    "Idempotency-Key must be 1 to 255 visible characters",
                )
            })?
            .to_owned(),
    };
    let scope = format!("{}:{}", principal.idempotency_scope(), req.path());
    let hash = Sha256::digest(serde_json::to_vec(body).unwrap_or_default()).to_vec();
    if !store::idempotency::claim(&state.pool, &scope, &key, &hash).await? {
        let row = store::idempotency::get(&state.pool, &scope, &key)
            .await?
            .ok_or_else(|| {
                ApiError::conflict("idempotency_key_in_progress", "retry in a moment")
            })?;
        if row.request_hash != hash {
            return Err(ApiError::conflict(
                "idempotency_key_reused",
                "this Idempotency-Key was used with a different request body",
            ));
        }
        return match row.response {
            Some(resp) => Ok(HttpResponse::Ok().json(resp)),
            None => Err(ApiError::conflict(
                "idempotency_key_in_progress",
                "a request with this Idempotency-Key is still being processed",
            )),
        };
    }
    match create().await {
        Ok((status, out)) => {
            let value = serde_json::to_value(&out).map_err(ApiError::internal)?;
            store::idempotency::complete(&state.pool, &scope, &key, status.as_u16() as i16, &value)
                .await?;
            Ok(HttpResponse::build(status).json(value))
        }
        Err(e) => {
            // A failed request may be retried with the same key.
            let _ = store::idempotency::release(&state.pool, &scope, &key).await;
            Err(e)
        }
    }
}
