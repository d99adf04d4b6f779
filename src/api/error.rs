//! The one wire error: `application/problem+json` (RFC 9457) with a stable `code`.
//! Every failure a client can see is built here; unexpected errors are logged with their
//! whole chain and answered with an opaque 500.

use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;
use utoipa::ToSchema;

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
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub detail: String,
    pub errors: Vec<FieldError>,
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
        }
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

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::RowNotFound => ApiError::not_found("resource"),
            sqlx::Error::Database(db) if db.is_unique_violation() => {
                ApiError::conflict("conflict", "a resource with these values already exists")
            }
            _ if crate::events::is_unavailable(&e) => {
                tracing::error!(error = %e, "database unavailable");
                ApiError::store_unavailable()
            }
            _ => ApiError::internal(e),
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
        if self.status == StatusCode::UNAUTHORIZED {
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
