//! Idempotent creation: the same key from the same principal for the same operation with
//! the same request fingerprint returns the original response instead of creating again;
//! a different fingerprint is refused (`IdempotencyKeyReused`). The caller supplies the
//! key and the fingerprint as plain values (the API reads them from the request).

use std::future::Future;

use serde::Serialize;
use serde_json::Value;

use super::{ServiceContext, ServiceError, ServiceResult};
use crate::auth::Principal;
use crate::store;

/// The response code recorded with a completed creation (every create answers "created").
const CREATED: i16 = 201;

/// A client's idempotency key and the fingerprint of its request.
#[derive(Debug, Clone)]
pub struct IdempotencyKey {
    pub key: String,
    pub fingerprint: Vec<u8>,
}

/// What an idempotent creation produced.
#[derive(Debug)]
pub enum Creation {
    /// Created now.
    Created(Value),
    /// Created by an earlier request with the same key; this is its response.
    Replayed(Value),
}

/// Run `create` at most once per key, scoped to the principal and `operation`.
pub async fn create_once<T, F, Fut>(
    ctx: &ServiceContext,
    principal: &Principal,
    operation: &str,
    key: Option<IdempotencyKey>,
    create: F,
) -> ServiceResult<Creation>
where
    T: Serialize,
    F: FnOnce() -> Fut,
    Fut: Future<Output = ServiceResult<T>>,
{
    let Some(IdempotencyKey { key, fingerprint }) = key else {
        let out = create().await?;
        return Ok(Creation::Created(to_value(&out)?));
    };
    let scope = format!("{}:{operation}", principal.idempotency_scope());
    if !store::idempotency::claim(&ctx.pool, &scope, &key, &fingerprint).await? {
        let row = store::idempotency::get(&ctx.pool, &scope, &key)
            .await?
            .ok_or(ServiceError::IdempotencyKeyInProgress("retry in a moment"))?;
        if row.request_hash != fingerprint {
            return Err(ServiceError::IdempotencyKeyReused);
        }
        return match row.response {
            Some(resp) => Ok(Creation::Replayed(resp)),
            None => Err(ServiceError::IdempotencyKeyInProgress(
                "a request with this Idempotency-Key is still being processed",
            )),
        };
    }
    match create().await {
        Ok(out) => {
            let value = to_value(&out)?;
            store::idempotency::complete(&ctx.pool, &scope, &key, CREATED, &value).await?;
            Ok(Creation::Created(value))
        }
        Err(e) => {
            // A failed request may be retried with the same key.
            let _ = store::idempotency::release(&ctx.pool, &scope, &key).await;
            Err(e)
        }
    }
}

fn to_value(out: &impl Serialize) -> ServiceResult<Value> {
    serde_json::to_value(out).map_err(|e| ServiceError::Unexpected(e.into()))
}
