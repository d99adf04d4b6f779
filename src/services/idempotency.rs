//! Idempotent creation: the same key from the same principal for the same operation with
//! the same request fingerprint returns the original response instead of creating again;
//! a different fingerprint is refused (`IdempotencyKeyReused`). The caller supplies the
//! key and the fingerprint as plain values (the API reads them from the request).
//!
//! Some responses carry a secret shown only once: a new API token (`token`), and any
//! future creation whose answer holds a field named in `SECRET_FIELDS`. A retry of such a
//! creation is exactly the case `Idempotency-Key` exists for — a CI job whose connection
//! dropped after the server created its token must get that token back, not a second one
//! it can never see and nobody will revoke. Refusing the header on those routes would
//! leave such a client with a token it cannot use and a retry that leaks another; storing
//! a hash would make the replay useless. So the stored response keeps every secret field
//! sealed with the server's keyring (AES-256-GCM, as team secrets), bound by its
//! associated data to the principal, key and field it was stored for; the replay opens
//! it. The database never holds the secret in the clear, and a completed key is kept only
//! `KEY_TTL_S` (24 h): after that it is treated as new and purged (`purge_expired`, run
//! periodically by `run_purge` in bounded batches).

use std::future::Future;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde::Serialize;
use serde_json::{Map, Value};
use uuid::Uuid;

use super::secrets::{Keyring, Sealed};
use super::{Access, Data, Lifecycle, ServiceError, ServiceResult};
use crate::auth::Principal;
use crate::domain::SecretValue;
use crate::store;

/// The response code recorded with a completed creation (every create answers "created").
const CREATED: i16 = 201;

/// Fields of a creation's answer that hold a secret shown only once. They are sealed in
/// the stored response, wherever they occur in it.
pub const SECRET_FIELDS: &[&str] = &["token", "secret", "client_secret", "refresh_token"];

/// The key under which a sealed field is stored in place of its value.
const SEALED_MARK: &str = "$sealed";

/// How often `run_purge` deletes expired keys, and how many per statement.
const PURGE_EVERY: Duration = Duration::from_secs(600);
const PURGE_BATCH: i64 = 1000;

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
#[tracing::instrument(name = "services::idempotency::create_once", skip_all)]
pub async fn create_once<T, F, Fut>(
    data: &Data,
    access: &Access,
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
    if !store::idempotency::claim(&data.pool, &scope, &key, &fingerprint).await? {
        let row = store::idempotency::get(&data.pool, &scope, &key)
            .await?
            .ok_or(ServiceError::IdempotencyKeyInProgress("retry in a moment"))?;
        if row.request_hash != fingerprint {
            return Err(ServiceError::IdempotencyKeyReused);
        }
        return match row.response {
            Some(resp) => Ok(Creation::Replayed(open(
                &access.secrets,
                &scope,
                &key,
                resp,
            )?)),
            None => Err(ServiceError::IdempotencyKeyInProgress(
                "a request with this Idempotency-Key is still being processed",
            )),
        };
    }
    match create().await {
        Ok(out) => {
            let value = to_value(&out)?;
            let stored = seal(&access.secrets, &scope, &key, value.clone());
            store::idempotency::complete(&data.pool, &scope, &key, CREATED, &stored).await?;
            Ok(Creation::Created(value))
        }
        Err(e) => {
            // A failed request may be retried with the same key.
            let _ = store::idempotency::release(&data.pool, &scope, &key).await;
            Err(e)
        }
    }
}

fn to_value(out: &impl Serialize) -> ServiceResult<Value> {
    serde_json::to_value(out).map_err(|e| ServiceError::Unexpected(e.into()))
}

/// What a sealed field is bound to: the key's scope, the key and the field's path.
fn sealed_name(scope: &str, key: &str, path: &str) -> String {
    format!("idempotency\0{scope}\0{key}\0{path}")
}

/// `value` with every string field named in `SECRET_FIELDS` sealed.
fn seal(keys: &Keyring, scope: &str, key: &str, value: Value) -> Value {
    walk(value, "", &mut |path, field| match field {
        Value::String(s) => {
            let sealed = keys.seal(
                Uuid::nil(),
                &sealed_name(scope, key, path),
                &SecretValue::new(s),
            );
            let mut inner = Map::new();
            inner.insert("key_id".into(), Value::from(sealed.key_id));
            inner.insert("nonce".into(), Value::from(B64.encode(&sealed.nonce)));
            inner.insert(
                "ciphertext".into(),
                Value::from(B64.encode(&sealed.ciphertext)),
            );
            let mut outer = Map::new();
            outer.insert(SEALED_MARK.into(), Value::Object(inner));
            Ok(Value::Object(outer))
        }
        other => Ok(other),
    })
    .unwrap_or_else(|never: std::convert::Infallible| match never {})
}

/// `value` as stored, with its sealed fields opened.
fn open(keys: &Keyring, scope: &str, key: &str, value: Value) -> ServiceResult<Value> {
    walk(value, "", &mut |path, field| {
        let Value::Object(outer) = &field else {
            return Ok(field);
        };
        let Some(Value::Object(inner)) = outer.get(SEALED_MARK) else {
            return Ok(field);
        };
        let text = |name: &str| inner.get(name).and_then(Value::as_str).unwrap_or_default();
        let bytes = |name: &str| B64.decode(text(name)).unwrap_or_default();
        let sealed = Sealed {
            key_id: text("key_id").to_owned(),
            nonce: bytes("nonce"),
            ciphertext: bytes("ciphertext"),
        };
        keys.open(Uuid::nil(), &sealed_name(scope, key, path), &sealed)
            .map(|v| Value::from(v.expose()))
            .map_err(|e| {
                ServiceError::Unexpected(anyhow::anyhow!(
                    "the stored response of this Idempotency-Key cannot be opened: {e}"
                ))
            })
    })
}

/// Rebuild `value`, passing every field named in `SECRET_FIELDS` (with its path) through
/// `f`.
fn walk<E>(
    value: Value,
    path: &str,
    f: &mut impl FnMut(&str, Value) -> Result<Value, E>,
) -> Result<Value, E> {
    Ok(match value {
        Value::Object(map) => {
            let mut out = Map::with_capacity(map.len());
            for (name, field) in map {
                let here = format!("{path}/{name}");
                let field = if SECRET_FIELDS.contains(&name.as_str()) {
                    f(&here, field)?
                } else {
                    walk(field, &here, f)?
                };
                out.insert(name, field);
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(
            items
                .into_iter()
                .enumerate()
                .map(|(i, v)| walk(v, &format!("{path}/{i}"), f))
                .collect::<Result<_, _>>()?,
        ),
        other => other,
    })
}

/// Delete the keys older than `store::idempotency::KEY_TTL_S`, a batch at a time, every
/// few minutes, until the server stops. Any replica may run it; they delete disjoint rows.
pub async fn run_purge(data: Data, lifecycle: Lifecycle) {
    let mut every = tokio::time::interval(PURGE_EVERY);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = lifecycle.stopping() => return,
        }
        loop {
            match store::idempotency::purge_expired(&data.pool, PURGE_BATCH).await {
                Ok(n) if n < PURGE_BATCH as u64 => break,
                Ok(_) => tokio::task::yield_now().await,
                Err(e) => {
                    tracing::warn!(error = %e, "could not purge expired idempotency keys");
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn secret_fields_are_sealed_bound_to_their_key_and_opened_again() {
        let keys = Keyring::new(&[7; 32], &[]);
        let answer = json!({"id": "tok_1", "token": "agt_pat_abc", "nested": [{"secret": "s3"}],
            "name": "ci"});
        let stored = seal(&keys, "u:", "k1", answer.clone());
        let text = stored.to_string();
        assert!(
            !text.contains("agt_pat_abc") && !text.contains("\"s3\""),
            "{text}"
        );
        assert_eq!(stored["id"], "tok_1");
        assert_eq!(stored["name"], "ci");
        assert_eq!(open(&keys, "u:", "k1", stored.clone()).unwrap(), answer);
        // Copied to another key or principal, it does not open.
        assert!(open(&keys, "u:", "k2", stored.clone()).is_err());
        assert!(open(&keys, "v:", "k1", stored).is_err());
    }
}
