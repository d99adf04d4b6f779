//! Who is calling and what they may touch. API tokens (`agt_pat_…`, random, stored as a
//! SHA-256 hash, revocable, scoped, expiring) resolve to a `Principal`: a user with their
//! team memberships, or a team service token acting with one role. JWTs from the
//! configured OpenID Connect provider (`oidc`) resolve to the user they name. The policy
//! — which role and which token scope each operation needs — lives in `policy`; the API
//! checks the scope of every route before its handler runs, and services check the role
//! in the team of the resource they touch. Nothing here knows HTTP: failures are
//! `AuthError`s, which the API maps to problem+json.

mod cache;
mod error;
pub mod oidc;
pub mod policy;
mod principal;
pub mod tokens;

pub use cache::TokenCache;
pub use error::AuthError;
pub use policy::Operation;
pub use principal::authenticate as authenticate_api_token;
pub use principal::{Access, ActorKind, AgentCaller, Membership, Principal, Role, Scope};

use std::sync::Arc;

use tokio::runtime::Handle;

use crate::store::DeadlinePool;

/// Resolve a bearer token: an agentry API token (`agt_pat_…`) by its hash, anything
/// shaped like a JWT by the identity provider when one is configured.
pub async fn authenticate(
    pool: &DeadlinePool,
    runtime: &Handle,
    cache: &Arc<TokenCache>,
    oidc: Option<&oidc::Oidc>,
    token: &str,
) -> Result<Principal, AuthError> {
    if token.len() > oidc::MAX_TOKEN_BYTES {
        return Err(AuthError::TokenTooLarge);
    }
    match oidc {
        Some(idp) if !token.starts_with(tokens::TOKEN_PREFIX) && oidc::looks_like_jwt(token) => {
            let claims = idp.validate_access_token(token).await?;
            let who = oidc::IdpIdentity::from_claims(&claims, idp.settings())?;
            oidc::principal_for(pool, idp.settings(), &who).await
        }
        _ => principal::authenticate(pool, runtime, cache, token).await,
    }
}
