//! Browser sign-in and sessions: start the provider's sign-in, finish it into a session,
//! sign out. The flow itself (PKCE, state, nonce, the ID token) is `auth::oidc::browser`.

use crate::auth::oidc::browser::{self, SignInError, SignedIn, Started};
use crate::auth::{AuthError, Principal};

use serde_json::json;

use super::audit;
use super::{Access, Data, ServiceError};

fn provider(access: &Access) -> Result<&crate::auth::oidc::Oidc, SignInError> {
    access.oidc.as_ref().ok_or(SignInError::NotConfigured)
}

/// Start a sign-in for a browser at `client_addr`: where to send it, and the pre-login
/// cookie that binds the sign-in to it; `return_to` is a path on this server.
#[tracing::instrument(name = "services::sessions::login_url", skip_all)]
pub async fn login_url(
    data: &Data,
    access: &Access,
    return_to: Option<&str>,
    client_addr: &str,
) -> Result<Started, SignInError> {
    browser::begin(provider(access)?, &data.pool, return_to, client_addr).await
}

/// Finish a sign-in the provider sent back to the browser whose pre-login cookie is
/// `browser`, opening a session. The sign-in is in the
/// audit log before the session is handed out; when it cannot be recorded, the session is
/// revoked again and the sign-in fails.
#[tracing::instrument(name = "services::sessions::finish_sign_in", skip_all)]
pub async fn finish_sign_in(
    data: &Data,
    access: &Access,
    code: &str,
    state: &str,
    browser: Option<&str>,
    request_id: Option<&str>,
) -> Result<SignedIn, SignInError> {
    let signed = browser::finish(provider(access)?, &data.pool, code, state, browser).await?;
    let recorded = audit::record_sign_in(
        data,
        signed.principal.user_id,
        request_id,
        json!({"method": "oidc", "issuer": provider(access)?.settings().issuer}),
    )
    .await;
    if let Err(e) = recorded {
        let _ = browser::sign_out(&data.pool, &signed.session).await;
        return Err(match e {
            ServiceError::Store(e) => SignInError::Auth(AuthError::Store(e)),
            ServiceError::Auth(a) => SignInError::Auth(a),
            other => SignInError::Failed(format!("the sign-in could not be recorded: {other}")),
        });
    }
    tracing::info!(user_id = %signed.principal.user_id, "browser sign-in");
    Ok(signed)
}

/// Revoke the session of this cookie value.
#[tracing::instrument(name = "services::sessions::sign_out", skip_all)]
pub async fn sign_out(data: &Data, cookie: &str) -> Result<(), AuthError> {
    browser::sign_out(&data.pool, cookie).await.map(|_| ())
}

/// The caller of a session cookie (`session_expired` when there is no live session).
#[tracing::instrument(name = "services::sessions::session_principal", skip_all)]
pub async fn session_principal(
    data: &Data,
    access: &Access,
    cookie: &str,
) -> Result<Principal, AuthError> {
    match &access.oidc {
        Some(idp) => browser::authenticate_session(idp, &data.pool, cookie).await,
        None => Err(AuthError::SessionExpired),
    }
}
