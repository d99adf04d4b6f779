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
            AuthError::NotVisible(_) => "not_found",
            AuthError::RoleTooLow { .. } | AuthError::Forbidden(_) => "forbidden",
            AuthError::InsufficientScope { .. } => "insufficient_scope",
            AuthError::Store(_) => "store",
        }
    }
}
