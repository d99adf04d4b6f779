//! A fake Gemini API on 127.0.0.1 for driving the real Gemini CLI (pointed at it with
//! `GOOGLE_GEMINI_BASE_URL`): `POST /v1beta/models/{model}:streamGenerateContent?alt=sse`
//! streams scripted replies as SSE `data:` chunks (text parts, `functionCall` parts,
//! `usageMetadata`), `:generateContent` answers one whole reply (the CLI's side
//! questions) and `:countTokens` a count. Each test queues the model's replies and reads
//! back the requests it received.
//!
//! Plain HTTP/1.1 over tokio, one request per connection (`connection: close`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

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
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeGemini {
    fn drop(&mut self) {
        self.task.abort();
    }
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
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = shared.clone();
                tokio::spawn(async move {
                    let _ = serve(stream, state).await;
                });
            }
        });
        Self { url, state, task }
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

async fn serve(mut stream: TcpStream, state: Arc<Mutex<State>>) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos + 4;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.lines();
    let request_line = lines.next().unwrap_or_default().to_owned();
    let headers: Vec<(&str, &str)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim(), v.trim()))
        .collect();
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.to_string())
    };
    let length: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let api_key = header("x-goog-api-key").unwrap_or_default();
    while buf.len() < head_end + length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = &buf[head_end..(head_end + length).min(buf.len())];
    let mut parts = request_line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_owned();
    let target = parts.next().unwrap_or_default().to_owned();
    let path = target.split('?').next().unwrap_or_default().to_owned();
    state
        .lock()
        .unwrap()
        .lines
        .push(format!("{method} {target}"));

    let action = path
        .strip_prefix("/v1beta/models/")
        .and_then(|rest| rest.split_once(':'))
        .map(|(_, action)| action.to_owned());
    match (method.as_str(), action.as_deref()) {
        ("POST", Some("streamGenerateContent")) => {
            let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            let reply = {
                let mut s = state.lock().unwrap();
                s.requests.push(request);
                s.api_keys.push(api_key);
                s.replies
                    .pop_front()
                    .unwrap_or_else(|| Reply::text("Done."))
            };
            stream_reply(&mut stream, &reply).await
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
            .await
        }
        ("POST", Some("countTokens")) => {
            respond_json(&mut stream, &json!({"totalTokens": 42})).await
        }
        _ => {
            stream
                .write_all(
                    b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                )
                .await
        }
    }
}

async fn respond_json(stream: &mut TcpStream, body: &Value) -> std::io::Result<()> {
    let body = body.to_string();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await
}

async fn chunk(stream: &mut TcpStream, data: Value) -> std::io::Result<()> {
    stream
        .write_all(format!("data: {data}\r\n\r\n").as_bytes())
        .await?;
    stream.flush().await
}

/// `text` in `n` pieces (at char boundaries).
fn pieces(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let size = chars.len().div_ceil(n.max(1)).max(1);
    chars.chunks(size).map(|c| c.iter().collect()).collect()
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

async fn stream_reply(stream: &mut TcpStream, reply: &Reply) -> std::io::Result<()> {
    stream
        .write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n",
        )
        .await?;
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
        if !reply.delay.is_zero() {
            tokio::time::sleep(reply.delay).await;
        }
        chunk(stream, candidate(parts, i + 1 == count)).await?;
    }
    if count == 0 {
        chunk(stream, candidate(json!([{"text": ""}]), true)).await?;
    }
    stream.shutdown().await
}
