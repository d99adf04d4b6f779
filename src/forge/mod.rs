//! The forges pull requests are opened on (GitHub, GitLab), through their REST APIs: one
//! module per forge behind [`Forge`]. The token is the project's credential; it goes
//! only into a request header, never into a URL, an error or a log.

mod github;
mod gitlab;

use std::time::Duration;

use serde::Serialize;
use utoipa::ToSchema;

pub use github::GitHub;
pub use gitlab::GitLab;

/// Which forge a project lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForgeKind {
    GitHub,
    GitLab,
}

impl ForgeKind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "github" => Some(Self::GitHub),
            "gitlab" => Some(Self::GitLab),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::GitHub => "github",
            Self::GitLab => "gitlab",
        }
    }

    /// The ref a pull/merge request's head is published under.
    pub fn pull_ref(self, number: u64) -> String {
        match self {
            Self::GitHub => format!("refs/pull/{number}/head"),
            Self::GitLab => format!("refs/merge-requests/{number}/head"),
        }
    }
}

/// A pull/merge request's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReviewState {
    Open,
    Merged,
    Closed,
}

impl ReviewState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Merged => "merged",
            Self::Closed => "closed",
        }
    }
}

/// The checks of a pull/merge request's head: none reported, some still running, all
/// passed, or at least one failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Checks {
    None,
    Pending,
    Passing,
    Failing,
}

impl Checks {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Pending => "pending",
            Self::Passing => "passing",
            Self::Failing => "failing",
        }
    }
}

/// A pull/merge request as the forge describes it.
#[derive(Debug, Clone)]
pub struct Review {
    pub number: i64,
    pub url: String,
    pub state: ReviewState,
    /// The commit its head is at, when the forge says.
    pub head_sha: Option<String>,
}

/// What a pull/merge request should say.
#[derive(Debug, Clone)]
pub struct ReviewSpec<'a> {
    /// The branch with the changes.
    pub head: &'a str,
    /// The branch they should go into.
    pub base: &'a str,
    pub title: &'a str,
    pub body: &'a str,
}

#[derive(Debug, thiserror::Error)]
pub enum ForgeError {
    /// The forge could not be reached, or failed (5xx, a malformed answer).
    #[error("the forge is unavailable: {0}")]
    Unavailable(String),
    /// The forge refused the request (4xx), with its message.
    #[error("the forge refused the request ({status}): {message}")]
    Refused { status: u16, message: String },
}

/// How to reach one repository on a forge.
pub struct Endpoint<'a> {
    pub http: &'a reqwest::Client,
    /// The REST API base, without a trailing slash.
    pub api: &'a str,
    /// `owner/name` (GitHub) or the project's path (GitLab).
    pub repo: &'a str,
    pub token: &'a str,
}

/// One forge's REST API.
pub trait Forge {
    /// The open pull/merge request whose head is `head`, if there is one.
    fn find_open(&self, head: &str) -> impl Future<Output = Result<Option<Review>, ForgeError>>;
    fn create(&self, spec: &ReviewSpec<'_>) -> impl Future<Output = Result<Review, ForgeError>>;
    /// Changes the title and body of pull/merge request `number`.
    fn update(
        &self,
        number: i64,
        spec: &ReviewSpec<'_>,
    ) -> impl Future<Output = Result<Review, ForgeError>>;
    /// The state of pull/merge request `number` and of its head's checks.
    fn status(&self, number: i64) -> impl Future<Output = Result<(Review, Checks), ForgeError>>;
}

/// Bound on one forge call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Sends `req` and reads a JSON answer; a 4xx is `Refused` with the forge's message.
async fn send(req: reqwest::RequestBuilder) -> Result<serde_json::Value, ForgeError> {
    let answer = req
        .timeout(CALL_TIMEOUT)
        .send()
        .await
        .map_err(|e| ForgeError::Unavailable(without_url(&e)))?;
    let status = answer.status();
    let body = answer
        .bytes()
        .await
        .map_err(|e| ForgeError::Unavailable(without_url(&e)))?;
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    if status.is_client_error() {
        let message = json["message"]
            .as_str()
            .map(str::to_owned)
            .or_else(|| {
                json["message"].as_array().map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str())
                        .collect::<Vec<_>>()
                        .join("; ")
                })
            })
            .or_else(|| json["error"].as_str().map(str::to_owned))
            .unwrap_or_else(|| status.to_string());
        return Err(ForgeError::Refused {
            status: status.as_u16(),
            message: message.chars().take(500).collect(),
        });
    }
    if !status.is_success() {
        return Err(ForgeError::Unavailable(format!(
            "the forge answered {status}"
        )));
    }
    if json.is_null() {
        return Err(ForgeError::Unavailable(
            "the forge's answer is not JSON".into(),
        ));
    }
    Ok(json)
}

/// Sends `req` and reads a text answer (a job's log), keeping at most its last `max`
/// bytes; a 4xx is `Refused`.
async fn send_text(req: reqwest::RequestBuilder, max: usize) -> Result<String, ForgeError> {
    let answer = req
        .timeout(CALL_TIMEOUT)
        .send()
        .await
        .map_err(|e| ForgeError::Unavailable(without_url(&e)))?;
    read_text(answer, max).await
}

/// Reads a text answer, keeping at most its last `max` bytes; a 4xx is `Refused`.
async fn read_text(answer: reqwest::Response, max: usize) -> Result<String, ForgeError> {
    use futures::StreamExt;
    let status = answer.status();
    if status.is_client_error() {
        return Err(ForgeError::Refused {
            status: status.as_u16(),
            message: status.to_string(),
        });
    }
    if !status.is_success() {
        return Err(ForgeError::Unavailable(format!(
            "the forge answered {status}"
        )));
    }
    // Logs can be long: keep a window of the end while reading.
    let mut kept: Vec<u8> = Vec::new();
    let mut body = answer.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| ForgeError::Unavailable(without_url(&e)))?;
        kept.extend_from_slice(&chunk);
        if kept.len() > 2 * max {
            kept.drain(..kept.len() - max);
        }
    }
    if kept.len() > max {
        kept.drain(..kept.len() - max);
    }
    Ok(String::from_utf8_lossy(&kept).into_owned())
}

/// A transport error, described briefly.
fn without_url(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "no answer in time".to_owned()
    } else if e.is_connect() {
        "cannot connect".to_owned()
    } else {
        let mut text = e.to_string();
        if let Some(url) = e.url() {
            text = text.replace(url.as_str(), "the forge");
        }
        text
    }
}

/// `pairs` as a URL query string.
fn query(pairs: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
}

fn malformed(what: &str) -> ForgeError {
    ForgeError::Unavailable(format!("the forge's answer lacks {what}"))
}
