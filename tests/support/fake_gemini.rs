//! A fake Gemini API on 127.0.0.1 for driving the real Gemini CLI (pointed at it with
//! `GOOGLE_GEMINI_BASE_URL`): `POST /v1beta/models/{model}:streamGenerateContent?alt=sse`
//! streams scripted replies as SSE `data:` chunks (text parts, `functionCall` parts,
//! `usageMetadata`), `:generateContent` answers one whole reply (the CLI's side
//! questions) and `:countTokens` a count. Each test queues the model's replies and reads
//! back the requests it received.
//!
//! Served by the shared loop and SSE writer of `http.rs`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::net::TcpStream;

use crate::http::{Request, Server, Sse, pieces, respond_empty, respond_json};

/// One part of a scripted reply.
#[derive(Debug, Clone)]
pub enum Part {
    Text(String),
    /// A call of tool `name` with `args` (`write_file`, `run_shell_command`, …).
    Call {
        name: String,
        args: Value,
    },
}

/// One model reply: its parts, each text streamed in `chunks` pieces with `delay` between
/// pieces.
#[derive(Debug, Clone)]
pub struct Reply {
    pub parts: Vec<Part>,
    pub chunks: usize,
    pub delay: Duration,
}

impl Reply {
    pub fn text(text: &str) -> Self {
        Self {
            parts: vec![Part::Text(text.to_owned())],
            chunks: 2,
            delay: Duration::ZERO,
        }
    }

    /// A sentence, then a call of tool `name` with `args`.
    pub fn tool(name: &str, args: Value) -> Self {
        Self {
            parts: vec![
                Part::Text("I'll do that.".to_owned()),
                Part::Call {
                    name: name.to_owned(),
                    args,
                },
            ],
            chunks: 1,
            delay: Duration::ZERO,
        }
    }

    /// Text streamed in `chunks` pieces, `delay` apart (for interrupts and kills).
    pub fn slow(text: &str, chunks: usize, delay: Duration) -> Self {
        Self {
            parts: vec![Part::Text(text.to_owned())],
            chunks,
            delay,
        }
    }
}

/// Tokens each streamed reply reports in `usageMetadata`.
pub const PROMPT_TOKENS: u64 = 120;
pub const REPLY_TOKENS: u64 = 15;

#[derive(Default)]
struct State {
    replies: VecDeque<Reply>,
    /// Bodies of `:streamGenerateContent` requests, in order.
    requests: Vec<Value>,
    /// Every request line seen (`POST /v1beta/models/m:streamGenerateContent?alt=sse`, …).
    lines: Vec<String>,
    /// The `x-goog-api-key` header of each streamed request (empty when absent).
    api_keys: Vec<String>,
}

pub struct FakeGemini {
    pub url: String,
    state: Arc<Mutex<State>>,
    _server: Server,
}

impl crate::cli_world::ModelFake for FakeGemini {
    fn launch() -> impl std::future::Future<Output = Self> {
        Self::start()
    }
    fn endpoint(&self) -> String {
        self.url.clone()
    }
}

impl FakeGemini {
    pub async fn start() -> Self {
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let server =
            Server::start(move |request, stream| serve(request, stream, shared.clone())).await;
        Self {
            url: server.url(),
            state,
            _server: server,
        }
    }

    /// Queue the model's next replies (when none is queued it answers "Done.").
    pub fn push(&self, reply: Reply) {
        self.state.lock().unwrap().replies.push_back(reply);
    }

    /// The bodies of the streamed requests received so far.
    pub fn requests(&self) -> Vec<Value> {
        self.state.lock().unwrap().requests.clone()
    }

    /// Every request line received so far.
    pub fn request_lines(&self) -> Vec<String> {
        self.state.lock().unwrap().lines.clone()
    }

    /// The `x-goog-api-key` each streamed request came with, in order.
    pub fn api_keys(&self) -> Vec<String> {
        self.state.lock().unwrap().api_keys.clone()
    }
}

/// All text in a request's `contents` (user prompts, function results, earlier replies).
pub fn conversation_text(request: &Value) -> String {
    let mut out = String::new();
    for content in request["contents"].as_array().into_iter().flatten() {
        for part in content["parts"].as_array().into_iter().flatten() {
            if let Some(text) = part["text"].as_str() {
                out.push_str(text);
                out.push('\n');
            }
            if let Some(response) = part.get("functionResponse") {
                out.push_str(&response.to_string());
                out.push('\n');
            }
        }
    }
    out
}

/// The `functionResponse` parts of a request, in order.
pub fn function_responses(request: &Value) -> Vec<Value> {
    request["contents"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| c["parts"].as_array().into_iter().flatten())
        .filter_map(|p| p.get("functionResponse").cloned())
        .collect()
}

async fn serve(request: Request, mut stream: TcpStream, state: Arc<Mutex<State>>) {
    state.lock().unwrap().lines.push(request.line.clone());
    let action = request
        .path
        .strip_prefix("/v1beta/models/")
        .and_then(|rest| rest.split_once(':'))
        .map(|(_, action)| action.to_owned());
    match (request.method.as_str(), action.as_deref()) {
        ("POST", Some("streamGenerateContent")) => {
            let reply = {
                let mut s = state.lock().unwrap();
                s.requests.push(request.json());
                s.api_keys.push(
                    request
                        .header("x-goog-api-key")
                        .unwrap_or_default()
                        .to_owned(),
                );
                s.replies
                    .pop_front()
                    .unwrap_or_else(|| Reply::text("Done."))
            };
            let _ = stream_reply(stream, &reply).await;
        }
        ("POST", Some("generateContent")) => {
            // The CLI's own side questions (next speaker, loop checks): a plain answer.
            respond_json(
                &mut stream,
                &json!({"candidates": [{"content": {"role": "model",
                    "parts": [{"text": "{\"next_speaker\": \"user\", \"reasoning\": \"done\"}"}]},
                    "finishReason": "STOP", "index": 0}],
                    "usageMetadata": {"promptTokenCount": 1, "candidatesTokenCount": 1,
                        "totalTokenCount": 2}}),
            )
            .await;
        }
        ("POST", Some("countTokens")) => {
            respond_json(&mut stream, &json!({"totalTokens": 42})).await;
        }
        _ => respond_empty(&mut stream, "404 Not Found").await,
    }
}

/// One SSE chunk: a candidate with `parts`, and the usage and finish reason on the last.
fn candidate(parts: Value, last: bool) -> Value {
    let mut candidate = json!({"content": {"role": "model", "parts": parts}, "index": 0});
    let mut data = json!({"modelVersion": "fake-model"});
    if last {
        candidate["finishReason"] = json!("STOP");
        data["usageMetadata"] = json!({"promptTokenCount": PROMPT_TOKENS,
            "candidatesTokenCount": REPLY_TOKENS,
            "totalTokenCount": PROMPT_TOKENS + REPLY_TOKENS});
    }
    data["candidates"] = json!([candidate]);
    data
}

async fn stream_reply(stream: TcpStream, reply: &Reply) -> std::io::Result<()> {
    let mut sse = Sse::start(stream).await?;
    let mut out: Vec<Value> = Vec::new();
    for part in &reply.parts {
        match part {
            Part::Text(text) => {
                for piece in pieces(text, reply.chunks) {
                    out.push(json!([{ "text": piece }]));
                }
            }
            Part::Call { name, args } => {
                out.push(json!([{ "functionCall": { "name": name, "args": args } }]));
            }
        }
    }
    let count = out.len();
    for (i, parts) in out.into_iter().enumerate() {
        sse.pause(reply.delay).await;
        sse.data(&candidate(parts, i + 1 == count)).await?;
    }
    if count == 0 {
        sse.data(&candidate(json!([{"text": ""}]), true)).await?;
    }
    sse.end().await
}
