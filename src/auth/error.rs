//! Why a caller was not let in or not allowed to do something. Each variant has a stable
//! code (`AuthError::code`); the HTTP status for it is chosen at the edge (`api::error`).

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("send `Authorization: Bearer <token>`")]
    TokenMissing,
    #[error("the token is larger than 16 KiB")]
    TokenTooLarge,
    #[error("{0}")]
    TokenMalformed(&'static str),
    #[error("this token was not issued by this server")]
    TokenUnknown,
    #[error("{0}")]
    TokenRevoked(&'static str),
    #[error("this token has expired")]
    TokenExpired,
    #[error("the token's signature does not verify with the identity provider's key")]
    TokenInvalidSignature,
    #[error("the token names a key the identity provider does not publish")]
    TokenUnknownKey,
    #[error("{0}")]
    TokenAlgorithmNotAllowed(String),
    #[error("this token is not valid yet")]
    TokenNotYetValid,
    #[error("the token was not issued by the configured identity provider")]
    TokenInvalidIssuer,
    #[error("the token is not meant for this server (audience)")]
    TokenInvalidAudience,
    #[error("the browser session has ended; sign in again")]
    SessionExpired,
    /// A cookie-authenticated request that changes state came from another origin.
    #[error("{0}")]
    CsrfRejected(&'static str),
    /// The identity provider's keys are not loaded yet (or it cannot be reached).
    #[error("{0}")]
    IdpUnavailable(String),
    /// A team (or a resource of a team) the caller cannot see: reported as missing.
    #[error("{0} not found")]
    NotVisible(&'static str),
    #[error("this needs the {needed} role in the team; you are {actual}")]
    RoleTooLow {
        needed: &'static str,
        actual: &'static str,
    },
    #[error("{0}")]
    Forbidden(&'static str),
    #[error("this token's scopes ({granted}) do not allow this; it needs `{needed}`")]
    InsufficientScope {
        needed: &'static str,
        granted: String,
    },
    #[error(transparent)]
    Store(#[from] sqlx::Error),
}

impl AuthError {
    /// The stable, documented code of this failure.
    pub fn code(&self) -> &'static str {
        match self {
            AuthError::TokenMissing => "token_missing",
            AuthError::TokenTooLarge => "token_too_large",
            AuthError::TokenMalformed(_) => "token_malformed",
            AuthError::TokenUnknown => "token_unknown",
            AuthError::TokenRevoked(_) => "token_revoked",
            AuthError::TokenExpired => "token_expired",
            AuthError::TokenInvalidSignature => "token_invalid_signature",
            AuthError::TokenUnknownKey => "token_unknown_key",
            AuthError::TokenAlgorithmNotAllowed(_) => "token_algorithm_not_allowed",
            AuthError::TokenNotYetValid => "token_not_yet_valid",
            AuthError::TokenInvalidIssuer => "token_invalid_issuer",
            AuthError::TokenInvalidAudience => "token_invalid_audience",
            AuthError::SessionExpired => "session_expired",
            AuthError::CsrfRejected(_) => "csrf_rejected",
            AuthError::IdpUnavailable(_) => "idp_unavailable",
            AuthError::NotVisible(_) => "not_found",
            AuthError::RoleTooLow { .. } | AuthError::Forbidden(_) => "forbidden",
            AuthError::InsufficientScope { .. } => "insufficient_scope",
            AuthError::Store(_) => "store",
        }
    }
}
