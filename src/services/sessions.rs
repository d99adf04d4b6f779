//! Browser sign-in and sessions: start the provider's sign-in, finish it into a session,
//! sign out. The flow itself (PKCE, state, nonce, the ID token) is `auth::oidc::browser`.

use crate::auth::oidc::browser::{self, SignInError, SignedIn};
use crate::auth::{AuthError, Principal};

use super::ServiceContext;

fn provider(ctx: &ServiceContext) -> Result<&crate::auth::oidc::Oidc, SignInError> {
    ctx.oidc.as_ref().ok_or(SignInError::NotConfigured)
}

/// Where to send the browser to sign in; `return_to` is a path on this server.
pub async fn login_url(
    ctx: &ServiceContext,
    return_to: Option<&str>,
) -> Result<String, SignInError> {
    browser::begin(provider(ctx)?, &ctx.pool, return_to).await
}

/// Finish a sign-in the provider sent back, opening a session.
pub async fn finish_sign_in(
    ctx: &ServiceContext,
    code: &str,
    state: &str,
) -> Result<SignedIn, SignInError> {
    let signed = browser::finish(provider(ctx)?, &ctx.pool, code, state).await?;
    record_sign_in(ctx, &signed.principal).await;
    Ok(signed)
}

/// The point where a completed browser sign-in is recorded (the `auth.sign_in` audit
/// entry belongs here).
async fn record_sign_in(_ctx: &ServiceContext, principal: &Principal) {
    tracing::info!(user_id = %principal.user_id, "browser sign-in");
}

/// Revoke the session of this cookie value.
pub async fn sign_out(ctx: &ServiceContext, cookie: &str) -> Result<(), AuthError> {
    browser::sign_out(&ctx.pool, cookie).await.map(|_| ())
}

/// The caller of a session cookie (`session_expired` when there is no live session).
pub async fn session_principal(ctx: &ServiceContext, cookie: &str) -> Result<Principal, AuthError> {
    match &ctx.oidc {
        Some(idp) => browser::authenticate_session(idp, &ctx.pool, cookie).await,
        None => Err(AuthError::SessionExpired),
    }
}
