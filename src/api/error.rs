//! The one wire error: `application/problem+json` (RFC 9457) with a stable `code`.
//! Every failure a client can see is built here: the domain errors of services, auth and
//! the runtime are mapped to a status and a code in one table below. Unexpected errors are
//! logged with their whole chain and answered with an opaque 500.

use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::AuthError;
use crate::events::WriteError;
use crate::runtime::RuntimeError;
use crate::services::ServiceError;

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

/// A problem+json body.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(example = json!({"type": "https://agentry.dev/problems/agent_busy", "title": "Agent busy",
    "status": 409, "detail": "a turn is running; wait for it or interrupt it", "code": "agent_busy"}))]
pub struct Problem {
    #[serde(rename = "type")]
    pub type_: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    pub code: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<FieldError>,
    /// The request's id (also in the `X-Request-Id` header and in every log line of the
    /// request): quote it when reporting a problem.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The request's OpenTelemetry trace id (32 hex digits), present only when the server
    /// exports traces (`log.otlp_endpoint`): look the request up in the trace viewer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// With `budget_exhausted`: the budget that is out, its period, limit, use and when
    /// it resets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::runtime::Exhausted>,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub detail: String,
    pub errors: Vec<FieldError>,
    /// The budget a `budget_exhausted` refusal names.
    pub budget: Option<Box<crate::runtime::Exhausted>>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status.as_u16(),
            self.code,
            self.detail
        )
    }
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            code,
            detail: detail.into(),
            errors: Vec::new(),
            budget: None,
        }
    }

    /// 429 `budget_exhausted`: the problem names the budget, its period and when it
    /// resets (also as `Retry-After`).
    pub fn budget_exhausted(x: Box<crate::runtime::Exhausted>) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "budget_exhausted",
            x.to_string(),
        );
        e.budget = Some(x);
        e
    }

    pub fn not_found(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{what} not found"),
        )
    }

    pub fn validation(field: &str, message: impl Into<String>) -> Self {
        let message = message.into();
        Self {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            code: "validation_failed",
            detail: format!("{field}: {message}"),
            errors: vec![FieldError {
                field: field.into(),
                message,
            }],
            budget: None,
        }
    }

    pub fn bad_request(code: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, detail)
    }

    pub fn conflict(code: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, detail)
    }

    pub fn unauthorized(code: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, code, detail)
    }

    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", detail)
    }

    /// An unexpected failure: log it with its chain, tell the client nothing more.
    pub fn internal(err: impl Into<anyhow::Error>) -> Self {
        let err = err.into();
        tracing::error!(error = ?err, "unexpected error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "an unexpected error occurred; see the server log",
        )
    }

    pub fn unavailable(code: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, code, detail)
    }

    /// 503 `store_unavailable`: the database is unreachable or stalled.
    pub fn store_unavailable() -> Self {
        Self::unavailable(
            "store_unavailable",
            "the database is unavailable; retry later",
        )
    }

    pub fn problem(&self) -> Problem {
        Problem {
            type_: format!("https://agentry.dev/problems/{}", self.code),
            title: title_of(self.code),
            status: self.status.as_u16(),
            detail: self.detail.clone(),
            code: self.code.to_owned(),
            errors: self.errors.clone(),
            request_id: None,
            trace_id: None,
            budget: self.budget.as_deref().cloned(),
        }
    }
}

fn title_of(code: &str) -> String {
    let mut t = code.replace('_', " ");
    if let Some(first) = t.get_mut(0..1) {
        first.make_ascii_uppercase();
    }
    t
}

// The edge table: every domain error becomes a problem with a stable code and a status.
// Codes come from the error itself (`ServiceError::code`, `AuthError::code`); statuses are
// chosen here, the only layer that knows HTTP.

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        use ServiceError as E;
        let status = match &e {
            E::Auth(a) => return a.into(),
            E::Runtime(_) | E::Store(_) | E::Events(_) | E::Git(_) | E::Unexpected(_) => {
                return match e {
                    E::Runtime(r) => runtime_error(r),
                    E::Store(s) => store_error(s),
                    E::Events(w) => write_error(w),
                    E::Git(g) => ApiError::internal(g),
                    E::Unexpected(u) => ApiError::internal(u),
                    _ => unreachable!("matched above"),
                };
            }
            E::Invalid { field, message } => return ApiError::validation(field, message.clone()),
            E::BudgetExhausted(x) => return ApiError::budget_exhausted(x.clone()),
            E::InvalidAt { field, message } => {
                return ApiError::validation(field, message.clone());
            }
            E::LimitReached { .. }
            | E::AgentChildrenExceeded { .. }
            | E::TeamChildrenExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
            E::OutsideAgentProject => StatusCode::FORBIDDEN,
            E::SignatureInvalid(_) => StatusCode::UNAUTHORIZED,
            E::NotFound(_) => StatusCode::NOT_FOUND,
            E::PromptTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            E::UnknownProvider(_) | E::ProviderUnavailable { .. } | E::HookFailed(_) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            E::RemoteUnavailable(_) | E::ForgeFailed(_) => StatusCode::BAD_GATEWAY,
            E::ProviderUnreachable(_) | E::StoreUnavailable | E::StoreDown(_) | E::NotReady => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            E::WorkspaceArchived(_)
            | E::SandboxUnavailable { .. }
            | E::SandboxRequired { .. }
            | E::AgentArchived
            | E::AgentDepthExceeded { .. }
            | E::ProjectNameTaken
            | E::ProjectHasWorkspaces
            | E::RepoInUse
            | E::TeamNameTaken
            | E::TeamNameReserved
            | E::LastOwner
            | E::UserEmailTaken
            | E::WorkspacePathTaken(_)
            | E::BranchExists(_)
            | E::RepositoryUnavailable(_)
            | E::NoRemote(_)
            | E::BranchProtected(_)
            | E::PushRejected(_)
            | E::NotPushed
            | E::PermissionExpired
            | E::MessageNotQueued(_)
            | E::IdempotencyKeyReused
            | E::IdempotencyKeyInProgress(_)
            | E::HookReadOnly => StatusCode::CONFLICT,
        };
        ApiError::new(status, e.code(), e.to_string())
    }
}

impl From<&AuthError> for ApiError {
    fn from(e: &AuthError) -> Self {
        use AuthError as E;
        let status = match e {
            E::TokenMissing
            | E::TokenTooLarge
            | E::TokenMalformed(_)
            | E::TokenUnknown
            | E::TokenRevoked(_)
            | E::TokenExpired
            | E::TokenInvalidSignature
            | E::TokenUnknownKey
            | E::TokenAlgorithmNotAllowed(_)
            | E::TokenNotYetValid
            | E::TokenInvalidIssuer
            | E::TokenInvalidAudience
            | E::SessionExpired => StatusCode::UNAUTHORIZED,
            E::CsrfRejected(_) => StatusCode::FORBIDDEN,
            E::IdpUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            E::NotVisible(_) => StatusCode::NOT_FOUND,
            E::RoleTooLow { .. } | E::Forbidden(_) | E::InsufficientScope { .. } => {
                StatusCode::FORBIDDEN
            }
            E::Store(s) => return store_error_ref(s),
        };
        ApiError::new(status, e.code(), e.to_string())
    }
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        (&e).into()
    }
}

fn runtime_error(e: RuntimeError) -> ApiError {
    use RuntimeError as E;
    match e {
        E::Busy => ApiError::conflict("agent_busy", e.to_string()),
        E::StartFailed(_) => ApiError::unavailable("provider_start_failed", e.to_string()),
        E::UnknownProvider(_) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown_provider",
            e.to_string(),
        ),
        E::PermissionNotFound => ApiError::not_found("permission request"),
        E::PermissionAlreadyResolved => {
            ApiError::conflict("permission_already_resolved", e.to_string())
        }
        E::PermissionExpired(_) => ApiError::conflict("permission_expired", e.to_string()),
        E::UnknownOption(_) | E::BehaviorMismatch { .. } => {
            ApiError::validation("option_id", e.to_string())
        }
        E::NoOptionForBehavior(_) => ApiError::validation("behavior", e.to_string()),
        E::Unsupported(m) => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "unsupported", m),
        E::ShuttingDown => ApiError::unavailable("shutting_down", e.to_string()),
        E::OwnedElsewhere(_) => ApiError::unavailable(
            "agent_moved",
            format!("{e}; the request could not be handed to it, retry"),
        ),
        E::ActorGone => ApiError::conflict(
            "agent_closed",
            "the agent closed while handling the request; retry",
        ),
        E::BudgetExhausted(x) => ApiError::budget_exhausted(x),
        E::Store(s) => store_error(s),
        E::Events(w) => write_error(w),
    }
}

/// The event writer failed an API write: 503 while the store is unavailable.
fn write_error(e: WriteError) -> ApiError {
    match e {
        WriteError::Unavailable => ApiError::store_unavailable(),
        WriteError::Stopped => ApiError::internal(e),
        // The agent's lease passed to another replica while this one wrote for it.
        WriteError::Fenced => ApiError::unavailable(
            "agent_moved",
            format!("{e}; retry, the replica that runs the agent now answers"),
        ),
    }
}

fn store_error(e: sqlx::Error) -> ApiError {
    store_error_ref(&e)
}

/// `RowNotFound` and a foreign key naming a row that does not exist are missing
/// resources; a unique violation is a conflict; an unreachable store is 503
/// `store_unavailable`; anything else is unexpected.
fn store_error_ref(e: &sqlx::Error) -> ApiError {
    match e {
        sqlx::Error::RowNotFound => ApiError::not_found("resource"),
        sqlx::Error::Database(db) if db.is_unique_violation() => {
            ApiError::conflict("conflict", "a resource with these values already exists")
        }
        sqlx::Error::Database(db) if db.is_foreign_key_violation() => {
            ApiError::not_found("a resource this request names")
        }
        // Known down: said once by `StoreHealth`, not again for every request.
        sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::NotConnected => {
            tracing::debug!(error = %e, "store unavailable");
            ApiError::store_unavailable()
        }
        _ if crate::events::is_unavailable(e) => {
            tracing::error!(error = %e, "store unavailable");
            ApiError::store_unavailable()
        }
        _ => {
            tracing::error!(error = ?e, "unexpected store error");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "an unexpected error occurred; see the server log",
            )
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut res = HttpResponse::build(self.status);
        res.insert_header((
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        ));
        if self.code == "store_unavailable" {
            res.insert_header((
                header::RETRY_AFTER,
                HeaderValue::from(crate::store::health::RETRY_AFTER_S),
            ));
        }
        if let Some(at) = self.budget.as_ref().and_then(|b| b.resets_at) {
            let s = (at - chrono::Utc::now()).num_seconds().max(1);
            res.insert_header((header::RETRY_AFTER, HeaderValue::from(s)));
        }
        // A webhook's signature is not a bearer token: no challenge for it.
        if self.status == StatusCode::UNAUTHORIZED && self.code != "signature_invalid" {
            let v = format!(
                "Bearer error=\"invalid_token\", error_description=\"{}\"",
                self.code
            );
            if let Ok(v) = HeaderValue::from_str(&v) {
                res.insert_header((header::WWW_AUTHENTICATE, v));
            }
        }
        res.body(serde_json::to_string(&self.problem()).unwrap_or_default())
    }
}

pub type ApiResult<T> = Result<T, ApiError>;
