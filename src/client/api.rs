//! The client's view of a server: JSON calls that turn every failure into a
//! [`ClientError`] (which decides the exit status), and an event stream that resumes
//! after a dropped connection without a gap or a repeat.

use std::time::Duration;

use serde_json::Value;

use crate::event_stream::Parser;

/// Why a command could not do its work; each kind has its exit status.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The command line or its input is wrong (exit 2).
    #[error("{0}")]
    Usage(String),
    /// The server refused the token (exit 2).
    #[error("{0}")]
    Auth(String),
    /// The server could not be reached (exit 2).
    #[error("cannot reach {url}: {why}")]
    Connection { url: String, why: String },
    /// The server answered with a problem (exit 2).
    #[error("{0}")]
    Api(String),
}

pub type ClientResult<T> = Result<T, ClientError>;

/// A server and the token to call it with.
#[derive(Clone)]
pub struct Api {
    client: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Api {
    pub fn new(base: &str, token: Option<String>) -> ClientResult<Self> {
        let base = base.trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(ClientError::Usage(format!(
                "the server URL must start with http:// or https:// (got `{base}`)"
            )));
        }
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| ClientError::Usage(format!("cannot build an HTTP client: {e}")))?;
        Ok(Self {
            client,
            base,
            token,
        })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let req = self.client.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    fn connection(&self, e: reqwest::Error) -> ClientError {
        ClientError::Connection {
            url: self.base.clone(),
            why: e.to_string(),
        }
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> ClientResult<Value> {
        let res = req.send().await.map_err(|e| self.connection(e))?;
        self.answer(res).await
    }

    /// A response's JSON body, or its refusal as an error.
    async fn answer(&self, res: reqwest::Response) -> ClientResult<Value> {
        let status = res.status();
        let text = res.text().await.map_err(|e| self.connection(e))?;
        let body: Value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        if status.is_success() {
            return Ok(body);
        }
        let code = body["code"].as_str().unwrap_or("");
        let detail = body["detail"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| body.to_string());
        let message = if code.is_empty() {
            format!("the server answered {status}: {detail}")
        } else {
            format!("{detail} ({code}, {})", status.as_u16())
        };
        if status == reqwest::StatusCode::UNAUTHORIZED {
            return Err(ClientError::Auth(format!(
                "{message}; set AGENTRY_TOKEN, pass --token or run `agentry login`"
            )));
        }
        Err(ClientError::Api(message))
    }

    pub async fn get(&self, path: &str) -> ClientResult<Value> {
        self.send(self.request(reqwest::Method::GET, path)).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> ClientResult<Value> {
        self.send(self.request(reqwest::Method::POST, path).json(body))
            .await
    }

    /// A `POST` whose refusals are answers too: the status and the body (a problem's
    /// `code` says what to do next); only an unreachable server is an error.
    pub async fn post_status(&self, path: &str, body: &Value) -> ClientResult<(u16, Value)> {
        let res = self
            .request(reqwest::Method::POST, path)
            .json(body)
            .send()
            .await
            .map_err(|e| self.connection(e))?;
        let status = res.status().as_u16();
        let text = res.text().await.map_err(|e| self.connection(e))?;
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }

    pub async fn delete(&self, path: &str) -> ClientResult<Value> {
        self.send(self.request(reqwest::Method::DELETE, path)).await
    }

    /// Every item of a paged list (`{"items", "next_cursor"}`), following the cursor.
    pub async fn list(&self, path: &str) -> ClientResult<Vec<Value>> {
        let sep = if path.contains('?') { '&' } else { '?' };
        let mut items = Vec::new();
        let mut next = format!("{path}{sep}limit=200");
        loop {
            let page = self.get(&next).await?;
            items.extend(page["items"].as_array().cloned().unwrap_or_default());
            match page["next_cursor"].as_str() {
                Some(c) => next = format!("{path}{sep}limit=200&cursor={c}"),
                None => return Ok(items),
            }
        }
    }

    /// Follow an agent's events after `after`, handing each to `on_event` until it
    /// answers `false`. A dropped connection is reopened with `Last-Event-ID` (a few
    /// times, with a pause), so nothing is missed or repeated.
    pub async fn follow(
        &self,
        agent: &str,
        mut after: i64,
        mut on_event: impl AsyncFnMut(Value) -> ClientResult<bool>,
    ) -> ClientResult<()> {
        let path = format!("/v1/agents/{agent}/events");
        let mut failures = 0;
        loop {
            let res = self
                .request(reqwest::Method::GET, &path)
                .header("Last-Event-ID", after.to_string())
                .send()
                .await;
            let mut res = match res {
                Ok(r) if r.status().is_success() => r,
                // A refusal (unknown agent, bad token) is final.
                Ok(r) => return self.answer(r).await.map(|_| ()),
                Err(e) => {
                    failures += 1;
                    if failures > RECONNECTS {
                        return Err(self.connection(e));
                    }
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                    continue;
                }
            };
            let mut stream = Parser::new();
            // Until the stream ends, breaks or goes silent past the server's pings; then
            // reconnect.
            while let Ok(Ok(Some(bytes))) = tokio::time::timeout(SILENCE, res.chunk()).await {
                failures = 0;
                for message in stream.push(&bytes) {
                    let Ok(event) = serde_json::from_str::<Value>(&message.data) else {
                        continue;
                    };
                    let seq = event["seq"].as_i64().unwrap_or(0);
                    if seq <= after {
                        continue;
                    }
                    after = seq;
                    if !on_event(event).await? {
                        return Ok(());
                    }
                }
            }
            failures += 1;
            if failures > RECONNECTS {
                return Err(ClientError::Connection {
                    url: self.base.clone(),
                    why: "the event stream kept breaking".into(),
                });
            }
            tokio::time::sleep(RECONNECT_PAUSE).await;
        }
    }
}

/// Reconnections in a row without receiving anything before giving up.
const RECONNECTS: u32 = 20;
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);
/// The server pings every 15 s; this long without a byte means the stream is dead.
const SILENCE: Duration = Duration::from_secs(45);
