//! `Idempotency-Key` on create requests: the header is read and checked here, the body's
//! fingerprint computed, and the service's answer turned into a response — 201 when
//! created now, 200 with the original body when replayed.

use std::future::Future;

use actix_web::{HttpRequest, HttpResponse};
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::error::{ApiError, ApiResult};
use crate::auth::Principal;
use crate::services::idempotency::{Creation, IdempotencyKey, create_once};
use crate::services::{Access, Data, ServiceResult};

const HEADER: &str = "idempotency-key";

/// Run `create` once per idempotency key and answer with its JSON.
pub async fn respond<B, T, F, Fut>(
    data: &Data,
    access: &Access,
    principal: &Principal,
    req: &HttpRequest,
    body: &B,
    create: F,
) -> ApiResult<HttpResponse>
where
    B: Serialize,
    T: Serialize,
    F: FnOnce() -> Fut,
    Fut: Future<Output = ServiceResult<T>>,
{
    let key = match req.headers().get(HEADER) {
        None => None,
        Some(v) => {
            let key = v
                .to_str()
                .ok()
                .filter(|k| !k.is_empty() && k.len() <= 255)
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "invalid_idempotency_key",
                        "Idempotency-Key must be 1 to 255 visible characters",
                    )
                })?;
            Some(IdempotencyKey {
                key: key.to_owned(),
                fingerprint: Sha256::digest(serde_json::to_vec(body).unwrap_or_default()).to_vec(),
            })
        }
    };
    Ok(
        match create_once(data, access, principal, req.path(), key, create).await? {
            Creation::Created(v) => HttpResponse::Created().json(v),
            Creation::Replayed(v) => HttpResponse::Ok().json(v),
        },
    )
}
