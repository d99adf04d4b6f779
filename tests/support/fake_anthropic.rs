//! A fake Anthropic Messages API on 127.0.0.1 for driving the real Claude Code CLI:
//! `POST /v1/messages` streams scripted replies as SSE, `POST /v1/messages/count_tokens`,
//! `GET /v1/models` and `HEAD /api/hello` answer what the CLI expects. Each test queues
//! the model's replies and reads back the requests it received.
//!
//! Plain HTTP/1.1 over tokio, one request per connection (`connection: close`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One content block of a scripted reply.
#[derive(Debug, Clone)]
pub enum Block {
    Text(String),
    Thinking(String),
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
}

/// One model reply: its blocks, streamed in `chunks` pieces per text with `delay`
/// between pieces.
#[derive(Debug, Clone)]
pub struct Reply {
    pub blocks: Vec<Block>,
    pub chunks: usize,
    pub delay: Duration,
}

impl Reply {
    pub fn text(text: &str) -> Self {
        Self {
            blocks: vec![Block::Text(text.to_owned())],
            chunks: 2,
            delay: Duration::ZERO,
        }
    }

    /// A sentence, then a call of tool `name` with `input`.
    pub fn tool(name: &str, input: Value) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self {
            blocks: vec![
                Block::Text("I'll do that.".to_owned()),
                Block::ToolUse {
                    id: format!("toolu_fake{n:04}"),
                    name: name.to_owned(),
                    input,
                },
            ],
            chunks: 1,
            delay: Duration::ZERO,
        }
    }

    pub fn thinking(thinking: &str, text: &str) -> Self {
        Self {
            blocks: vec![
                Block::Thinking(thinking.to_owned()),
                Block::Text(text.to_owned()),
            ],
            chunks: 2,
            delay: Duration::ZERO,
        }
    }

    /// Text streamed in `chunks` pieces, `delay` apart (for interrupts and kills).
    pub fn slow(text: &str, chunks: usize, delay: Duration) -> Self {
        Self {
            blocks: vec![Block::Text(text.to_owned())],
            chunks,
            delay,
        }
    }
}

/// Computes a reply from the request it answers.
type Responder = Arc<dyn Fn(&Value) -> Reply + Send + Sync>;

#[derive(Default)]
struct State {
    replies: VecDeque<Reply>,
    /// Answers when no reply is queued.
    responder: Option<Responder>,
    /// Bodies of `POST /v1/messages`, in order.
    requests: Vec<Value>,
    /// Every request line seen (`POST /v1/messages?beta=true`, …).
    lines: Vec<String>,
    /// The `x-api-key` header of each `POST /v1/messages` (empty when absent).
    api_keys: Vec<String>,
    message_no: u64,
}

pub struct FakeAnthropic {
    pub url: String,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeAnthropic {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl crate::cli_world::ModelFake for FakeAnthropic {
    fn launch() -> impl std::future::Future<Output = Self> {
        Self::start()
    }
    fn endpoint(&self) -> String {
        self.url.clone()
    }
}

impl FakeAnthropic {
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

    /// Answer every request no queued reply answers with `respond(request)`: a model
    /// whose next step depends on what its tools returned.
    pub fn respond_with(&self, respond: impl Fn(&Value) -> Reply + Send + Sync + 'static) {
        self.state.lock().unwrap().responder = Some(Arc::new(respond));
    }

    /// The bodies of the `POST /v1/messages` requests received so far.
    pub fn requests(&self) -> Vec<Value> {
        self.state.lock().unwrap().requests.clone()
    }

    /// Every request line received so far.
    pub fn request_lines(&self) -> Vec<String> {
        self.state.lock().unwrap().lines.clone()
    }

    /// The `x-api-key` each `POST /v1/messages` came with, in order.
    pub fn api_keys(&self) -> Vec<String> {
        self.state.lock().unwrap().api_keys.clone()
    }
}

/// The text of a request's first message (the prompt of the conversation, with whatever
/// the CLI adds to it).
pub fn first_message_text(request: &Value) -> String {
    let mut out = String::new();
    collect_text(&request["messages"][0]["content"], &mut out);
    out
}

/// One `tool_result` the CLI sent back to the model.
#[derive(Debug, Clone)]
pub struct ToolResult {
    pub is_error: bool,
    pub text: String,
}

/// The `tool_result` blocks of a request's `messages`, in order.
pub fn tool_results(request: &Value) -> Vec<ToolResult> {
    let mut out = Vec::new();
    for message in request["messages"].as_array().into_iter().flatten() {
        for block in message["content"].as_array().into_iter().flatten() {
            if block["type"] == "tool_result" {
                let mut text = String::new();
                collect_text(&block["content"], &mut text);
                out.push(ToolResult {
                    is_error: block["is_error"] == true,
                    text,
                });
            }
        }
    }
    out
}

/// Whether the request offers the model a tool named `name`.
pub fn offers_tool(request: &Value, name: &str) -> bool {
    request["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| t["name"] == name)
}

/// All text in a request's `messages` (user prompts, tool results, earlier replies).
pub fn conversation_text(request: &Value) -> String {
    let mut out = String::new();
    for message in request["messages"].as_array().into_iter().flatten() {
        collect_text(&message["content"], &mut out);
        out.push('\n');
    }
    out
}

fn collect_text(value: &Value, out: &mut String) {
    match value {
        Value::String(s) => {
            out.push_str(s);
            out.push('\n');
        }
        Value::Array(items) => items.iter().for_each(|i| collect_text(i, out)),
        Value::Object(map) => {
            for key in ["text", "content", "thinking"] {
                if let Some(v) = map.get(key) {
                    collect_text(v, out);
                }
            }
        }
        _ => {}
    }
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
    let api_key = header("x-api-key").unwrap_or_default();
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

    match (method.as_str(), path.as_str()) {
        ("POST", "/v1/messages") => {
            let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            let (reply, number) = {
                let mut s = state.lock().unwrap();
                s.api_keys.push(api_key);
                s.message_no += 1;
                let reply = match (s.replies.pop_front(), &s.responder) {
                    (Some(queued), _) => queued,
                    (None, Some(respond)) => respond(&request),
                    (None, None) => Reply::text("Done."),
                };
                s.requests.push(request);
                (reply, s.message_no)
            };
            stream_reply(&mut stream, &reply, number).await
        }
        ("POST", "/v1/messages/count_tokens") => {
            respond_json(&mut stream, &json!({"input_tokens": 42})).await
        }
        ("GET", "/v1/models") => {
            respond_json(
                &mut stream,
                &json!({"data": [{"type": "model", "id": "fake-model-1",
                    "display_name": "Fake model", "created_at": "2026-01-01T00:00:00Z"}],
                    "has_more": false, "first_id": "fake-model-1", "last_id": "fake-model-1"}),
            )
            .await
        }
        ("HEAD", _) => {
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                .await
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

async fn event(stream: &mut TcpStream, data: Value) -> std::io::Result<()> {
    let kind = data["type"].as_str().unwrap_or("ping").to_owned();
    stream
        .write_all(format!("event: {kind}\ndata: {data}\n\n").as_bytes())
        .await?;
    stream.flush().await
}

/// `text` in `n` pieces (at char boundaries).
fn pieces(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let size = chars.len().div_ceil(n.max(1)).max(1);
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}

async fn stream_reply(stream: &mut TcpStream, reply: &Reply, number: u64) -> std::io::Result<()> {
    stream
        .write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n",
        )
        .await?;
    let id = format!("msg_fake{number:04}");
    event(
        stream,
        json!({"type": "message_start", "message": {"id": id, "type": "message",
            "role": "assistant", "model": "fake-model-1", "content": [], "stop_reason": null,
            "stop_sequence": null, "usage": {"input_tokens": 25, "output_tokens": 1}}}),
    )
    .await?;
    let mut stop_reason = "end_turn";
    for (index, block) in reply.blocks.iter().enumerate() {
        match block {
            Block::Text(text) => {
                event(
                    stream,
                    json!({"type": "content_block_start", "index": index,
                    "content_block": {"type": "text", "text": ""}}),
                )
                .await?;
                for piece in pieces(text, reply.chunks) {
                    if !reply.delay.is_zero() {
                        tokio::time::sleep(reply.delay).await;
                    }
                    event(
                        stream,
                        json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": piece}}),
                    )
                    .await?;
                }
            }
            Block::Thinking(text) => {
                event(
                    stream,
                    json!({"type": "content_block_start", "index": index,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
                )
                .await?;
                for piece in pieces(text, reply.chunks) {
                    event(
                        stream,
                        json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "thinking_delta", "thinking": piece}}),
                    )
                    .await?;
                }
                event(
                    stream,
                    json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "signature_delta", "signature": "c2ln"}}),
                )
                .await?;
            }
            Block::ToolUse { id, name, input } => {
                stop_reason = "tool_use";
                event(
                    stream,
                    json!({"type": "content_block_start", "index": index,
                    "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
                )
                .await?;
                event(
                    stream,
                    json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
                )
                .await?;
            }
        }
        event(
            stream,
            json!({"type": "content_block_stop", "index": index}),
        )
        .await?;
    }
    event(
        stream,
        json!({"type": "message_delta", "delta": {"stop_reason": stop_reason,
            "stop_sequence": null}, "usage": {"output_tokens": 15}}),
    )
    .await?;
    event(stream, json!({"type": "message_stop"})).await?;
    stream.shutdown().await
}
