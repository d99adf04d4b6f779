//! Device authorization (RFC 8628): how a client without a browser — `agentry login` on
//! a laptop or a remote shell — gets an API token. The client asks for a code pair
//! ([`start`]), shows its person the user code and a dashboard URL, and polls
//! ([`collect`]) with the device code; the person, signed in to the dashboard, looks the
//! request up ([`describe`]) and approves or denies it ([`answer`]). Once approved, the
//! client's next poll gets a new personal token of the approver (with no more scopes
//! than the approver's own token had), audited as the approver's `token.create`; the
//! code is then spent.
//!
//! Both codes are stored as hashes, and the token is generated at collection, so the
//! database never holds a usable secret. Codes live ten minutes; starting is limited per
//! client address.

use chrono::{DateTime, Utc};
use rand::{Rng, RngCore};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};
use utoipa::ToSchema;
use uuid::Uuid;

use super::audit::{self, Action, Actor, Entry};
use super::{Data, ServiceError};
use crate::auth::{ActorKind, AuthError, Operation, Principal, tokens};
use crate::domain::{TokenId, UserId};
use crate::store;

/// How long a code pair is good for.
pub const LIFETIME: chrono::Duration = chrono::Duration::minutes(10);
/// Seconds a client waits between polls.
pub const INTERVAL_S: i32 = 5;
/// Code pairs one client address may request per minute.
pub const STARTS_PER_MINUTE: i64 = 10;
/// Letters of user codes: no vowels (no words), none that look alike (RFC 8628 §6.1).
const USER_CODE_ALPHABET: &[u8] = b"BCDFGHJKLMNPQRSTVWXZ";
const USER_CODE_LEN: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("the request is not answered yet; poll again in `interval` seconds")]
    AuthorizationPending,
    #[error("polling too fast: wait {0} seconds between polls")]
    SlowDown(i32),
    #[error("the device code expired; run the sign-in again")]
    ExpiredToken,
    #[error("the request was denied")]
    AccessDenied,
    #[error("this request was already answered")]
    AlreadyAnswered,
    #[error("too many sign-in codes requested from this address; retry in a minute")]
    TooManyRequests,
    #[error(transparent)]
    Service(#[from] ServiceError),
}

impl DeviceError {
    pub fn code(&self) -> &'static str {
        match self {
            DeviceError::AuthorizationPending => "authorization_pending",
            DeviceError::SlowDown(_) => "slow_down",
            DeviceError::ExpiredToken => "expired_token",
            DeviceError::AccessDenied => "access_denied",
            DeviceError::AlreadyAnswered => "device_code_answered",
            DeviceError::TooManyRequests => "too_many_requests",
            DeviceError::Service(e) => e.code(),
        }
    }
}

impl From<AuthError> for DeviceError {
    fn from(e: AuthError) -> Self {
        DeviceError::Service(e.into())
    }
}

impl From<sqlx::Error> for DeviceError {
    fn from(e: sqlx::Error) -> Self {
        DeviceError::Service(e.into())
    }
}

pub type DeviceResult<T> = Result<T, DeviceError>;

#[derive(Debug, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"client_name": "agentry CLI on build-7"}))]
pub struct StartDevice {
    /// What the client is, shown to the approver and used as the token's name
    /// (default `agentry CLI`).
    pub client_name: Option<String>,
}

/// A code pair (RFC 8628 §3.2).
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"device_code": "dev_5b0c…", "user_code": "BCDF-GHJK",
    "verification_uri": "https://agentry.example.com/device",
    "verification_uri_complete": "https://agentry.example.com/device?code=BCDF-GHJK",
    "expires_in": 600, "interval": 5}))]
pub struct DeviceAuthorization {
    /// The client's secret: poll `POST /auth/device/token` with it.
    pub device_code: String,
    /// What the person types (or sees) on the dashboard's device page.
    pub user_code: String,
    pub verification_uri: String,
    pub verification_uri_complete: String,
    /// Seconds until both codes expire.
    pub expires_in: i64,
    /// Seconds to wait between polls.
    pub interval: i32,
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"device_code": "dev_5b0c…"}))]
pub struct DeviceTokenRequest {
    pub device_code: String,
}

/// The token minted when the person approved (RFC 8628 §3.5, with agentry's fields).
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"access_token": "agt_pat_3f1c…", "token_type": "Bearer",
    "id": "tok_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "agentry CLI on build-7",
    "prefix": "agt_pat_3f1c", "expires_at": null}))]
pub struct DeviceToken {
    /// The API token. Shown only in this response.
    pub access_token: String,
    pub token_type: &'static str,
    pub id: TokenId,
    pub name: String,
    pub prefix: String,
    pub expires_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"user_code": "BCDF-GHJK"}))]
pub struct AnswerDevice {
    /// The code the client shows (case and dashes do not matter).
    pub user_code: String,
}

/// A pending request, as the approver sees it.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"user_code": "BCDF-GHJK", "client_name": "agentry CLI on build-7",
    "status": "pending", "created_at": "2026-11-30T12:00:00Z", "expires_at": "2026-11-30T12:10:00Z"}))]
pub struct DeviceRequest {
    pub user_code: String,
    pub client_name: String,
    /// `pending`, `approved`, `denied` or `used`.
    pub status: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

fn user_code() -> String {
    let mut rng = rand::rng();
    (0..USER_CODE_LEN)
        .map(|_| USER_CODE_ALPHABET[rng.random_range(0..USER_CODE_ALPHABET.len())] as char)
        .collect()
}

/// `BCDFGHJK` → `BCDF-GHJK`.
fn shown(code: &str) -> String {
    format!("{}-{}", &code[..4], &code[4..])
}

/// A user code as typed (any case, dashes and spaces anywhere), when it can be one.
fn normalize_user_code(typed: &str) -> Option<String> {
    let code: String = typed
        .chars()
        .filter(|c| *c != '-' && !c.is_whitespace())
        .map(|c| c.to_ascii_uppercase())
        .collect();
    (code.len() == USER_CODE_LEN && code.bytes().all(|b| USER_CODE_ALPHABET.contains(&b)))
        .then_some(code)
}

fn user_code_hash(code: &str) -> Vec<u8> {
    Sha256::digest(format!("agentry user code:{code}")).to_vec()
}

fn device_code_hash(code: &str) -> Vec<u8> {
    Sha256::digest(format!("agentry device code:{code}")).to_vec()
}

/// Start a sign-in for a client at `client_ip`; `verification_uri` is the dashboard's
/// device page as the client reached this server.
#[tracing::instrument(name = "services::device::start", skip_all)]
pub async fn start(
    data: &Data,
    body: &StartDevice,
    client_ip: &str,
    verification_uri: &str,
) -> DeviceResult<DeviceAuthorization> {
    let client_name = match body.client_name.as_deref().map(str::trim) {
        None | Some("") => "agentry CLI".to_owned(),
        Some(n) if n.chars().count() > 100 || n.chars().any(char::is_control) => {
            return Err(ServiceError::invalid(
                "client_name",
                "must be at most 100 characters, without control characters",
            )
            .into());
        }
        Some(n) => n.to_owned(),
    };
    let now = Utc::now();
    let recent = store::device_codes::count_recent(
        &data.pool,
        client_ip,
        now - chrono::Duration::minutes(1),
    )
    .await?;
    if recent >= STARTS_PER_MINUTE {
        return Err(DeviceError::TooManyRequests);
    }
    // Spent and expired codes are of no use to anyone.
    store::device_codes::delete_expired(&data.pool, now - chrono::Duration::hours(1)).await?;
    let mut secret = [0u8; 32];
    rand::rng().fill_bytes(&mut secret);
    let device_code = format!("dev_{}", hex::encode(secret));
    let code = user_code();
    let expires_at = now + LIFETIME;
    store::device_codes::insert(
        &data.pool,
        Uuid::now_v7(),
        &device_code_hash(&device_code),
        &user_code_hash(&code),
        &client_name,
        client_ip,
        INTERVAL_S,
        expires_at,
    )
    .await?;
    Ok(DeviceAuthorization {
        device_code,
        user_code: shown(&code),
        verification_uri: verification_uri.to_owned(),
        verification_uri_complete: format!("{verification_uri}?code={}", shown(&code)),
        expires_in: LIFETIME.num_seconds(),
        interval: INTERVAL_S,
    })
}

/// The client's poll: the token once approved (and never again), else why not yet.
#[tracing::instrument(name = "services::device::collect", skip_all)]
pub async fn collect(
    data: &Data,
    body: &DeviceTokenRequest,
    request_id: Option<&str>,
) -> DeviceResult<DeviceToken> {
    let hash = device_code_hash(&body.device_code);
    let work = async {
        let mut tx = data.pool.pool().begin().await?;
        let Some(row) = store::device_codes::by_device_code_for_update(&mut *tx, &hash).await?
        else {
            return Err(ServiceError::NotFound("device code").into());
        };
        let now = Utc::now();
        if row.status == "used" {
            return Err(ServiceError::NotFound("device code").into());
        }
        if row.expires_at <= now {
            return Err(DeviceError::ExpiredToken);
        }
        let outcome = match row.status.as_str() {
            "denied" => Err(DeviceError::AccessDenied),
            "approved" => {
                let user = row.answered_by.ok_or_else(|| {
                    ServiceError::Unexpected(anyhow::anyhow!(
                        "device code {} is approved by nobody",
                        row.id
                    ))
                })?;
                let scopes = row.token_scopes.clone().unwrap_or_default();
                let token = tokens::generate();
                let id = TokenId::new();
                let inserted = store::identity::insert_token(
                    &mut *tx,
                    id.uuid(),
                    user,
                    None,
                    None,
                    &row.client_name,
                    &tokens::shown_prefix(&token),
                    &tokens::hash(&token),
                    &scopes,
                    None,
                )
                .await?;
                let kind = if row.answered_kind.as_deref() == Some("admin") {
                    ActorKind::Admin
                } else {
                    ActorKind::User
                };
                audit::record_in(
                    &mut *tx,
                    Actor {
                        kind,
                        id: user,
                        request_id,
                        on_behalf_of: None,
                    },
                    &Entry::new(Action::TokenCreate, None, "token", id).details(json!({
                        "name": row.client_name,
                        "user_id": UserId::from(user),
                        "scopes": scopes,
                        "via": "device",
                    })),
                )
                .await?;
                store::device_codes::mark_used(&mut *tx, row.id, id.uuid()).await?;
                Ok(DeviceToken {
                    access_token: token,
                    token_type: "Bearer",
                    id,
                    name: inserted.name,
                    prefix: inserted.prefix,
                    expires_at: inserted.expires_at,
                })
            }
            _ => {
                let too_soon = row.last_polled_at.is_some_and(|at| {
                    now - at < chrono::Duration::seconds(i64::from(row.interval_s))
                });
                store::device_codes::touch_polled(&mut *tx, row.id, now).await?;
                if too_soon {
                    Err(DeviceError::SlowDown(row.interval_s))
                } else {
                    Err(DeviceError::AuthorizationPending)
                }
            }
        };
        tx.commit().await?;
        outcome
    };
    match tokio::time::timeout(data.pool.deadline(), work).await {
        Ok(r) => r,
        Err(_) => Err(ServiceError::StoreUnavailable.into()),
    }
}

/// A request still open for an answer, by its user code.
async fn open_request(
    db: impl sqlx::PgExecutor<'_>,
    user_code: &str,
    lock: bool,
) -> DeviceResult<(String, store::device_codes::DeviceCodeRow)> {
    let code = normalize_user_code(user_code).ok_or(ServiceError::NotFound("device code"))?;
    let row = store::device_codes::by_user_code(db, &user_code_hash(&code), lock)
        .await?
        .filter(|r| r.status != "used")
        .ok_or(ServiceError::NotFound("device code"))?;
    if row.expires_at <= Utc::now() {
        return Err(DeviceError::ExpiredToken);
    }
    Ok((code, row))
}

/// What the person about to approve sees: the client's description and the code's state.
#[tracing::instrument(name = "services::device::describe", skip_all)]
pub async fn describe(
    data: &Data,
    principal: &Principal,
    user_code: &str,
) -> DeviceResult<DeviceRequest> {
    principal.authorize(Operation::ReadSelf)?;
    let (code, row) = open_request(&data.pool, user_code, false).await?;
    Ok(DeviceRequest {
        user_code: shown(&code),
        client_name: row.client_name,
        status: row.status,
        created_at: row.created_at,
        expires_at: row.expires_at,
    })
}

/// Approve (minting a personal token of the approver for the client) or deny.
#[tracing::instrument(name = "services::device::answer", skip_all)]
pub async fn answer(
    data: &Data,
    principal: &Principal,
    body: &AnswerDevice,
    approve: bool,
) -> DeviceResult<DeviceRequest> {
    principal.authorize(Operation::ManageSelf)?;
    if principal.service_team.is_some() {
        return Err(AuthError::Forbidden(
            "a team service token cannot sign a device in; sign in as a person",
        )
        .into());
    }
    let work = async {
        let mut tx = data.pool.pool().begin().await?;
        let (code, row) = open_request(&mut *tx, &body.user_code, true).await?;
        if row.status != "pending" {
            return Err(DeviceError::AlreadyAnswered);
        }
        let (kind, _) = principal.actor();
        store::device_codes::answer(
            &mut *tx,
            row.id,
            if approve { "approved" } else { "denied" },
            principal.user_id,
            kind.as_str(),
            &principal.scopes,
        )
        .await?;
        tx.commit().await?;
        Ok(DeviceRequest {
            user_code: shown(&code),
            client_name: row.client_name,
            status: if approve { "approved" } else { "denied" }.to_owned(),
            created_at: row.created_at,
            expires_at: row.expires_at,
        })
    };
    match tokio::time::timeout(data.pool.deadline(), work).await {
        Ok(r) => r,
        Err(_) => Err(ServiceError::StoreUnavailable.into()),
    }
}
