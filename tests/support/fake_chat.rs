//! A fake OpenAI Chat Completions API on 127.0.0.1 for driving real agent CLIs that speak
//! it (Copilot's BYOK provider, OpenCode, Pi): `POST /v1/chat/completions` with
//! `stream: true` answers the next scripted reply as `chat.completion.chunk` server-sent
//! events — text in `delta.content`, tool calls in `delta.tool_calls` with their arguments
//! streamed in pieces, a `finish_reason`, a last chunk with `usage`, then `data: [DONE]`;
//! a request without `stream` gets one whole `chat.completion`. `GET /v1/models` lists
//! the model. Every request is recorded (path, headers, body) for the test to read.
//!
//! Plain HTTP/1.1 over tokio, one request per connection (`connection: close`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The model id the fake reports and the tests configure.
pub const MODEL: &str = "fake-model";

/// A tool call in a scripted reply.
#[derive(Debug, Clone)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: Value,
}

/// One scripted model reply: text streamed in `chunks` pieces `delay` apart, then any
/// tool calls (finish reason `tool_calls`, else `stop`).
#[derive(Debug, Clone)]
pub struct Reply {
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
    pub chunks: usize,
    pub delay: Duration,
    /// Stream what there is, then hold the response open without finishing it.
    pub stall: bool,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Reply {
    pub fn text(text: &str) -> Self {
        Self {
            text: text.to_owned(),
            tool_calls: Vec::new(),
            chunks: 3,
            delay: Duration::ZERO,
            stall: false,
            prompt_tokens: 30,
            completion_tokens: 7,
        }
    }

    /// A call of tool `name` with `arguments` (and no text).
    pub fn tool(name: &str, arguments: Value) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self {
            tool_calls: vec![ToolCall {
                id: format!("call_fake{n:04}"),
                name: name.to_owned(),
                arguments,
            }],
            ..Self::text("")
        }
    }

    /// Text streamed in `chunks` pieces, `delay` apart (for interrupts and kills).
    pub fn slow(text: &str, chunks: usize, delay: Duration) -> Self {
        Self {
            chunks,
            delay,
            ..Self::text(text)
        }
    }

    /// Text that starts to stream and never finishes.
    pub fn stalled(text: &str) -> Self {
        Self {
            stall: true,
            ..Self::text(text)
        }
    }
}

/// A request the fake received.
#[derive(Debug, Clone)]
pub struct Request {
    /// `POST /v1/chat/completions`, `GET /v1/models`, …
    pub line: String,
    /// Header names in lower case, with their values.
    pub headers: Vec<(String, String)>,
    pub body: Value,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct State {
    replies: VecDeque<Reply>,
    requests: Vec<Request>,
}

/// The fake server; it stops when dropped.
pub struct FakeChat {
    pub port: u16,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeChat {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl crate::cli_world::ModelFake for FakeChat {
    fn launch() -> impl std::future::Future<Output = Self> {
        Self::start()
    }
    fn endpoint(&self) -> String {
        self.base_url()
    }
}

impl FakeChat {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, shared.clone()));
            }
        });
        Self { port, state, task }
    }

    /// The base URL clients are given (`…/v1`).
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// Queue the model's next replies, served in order; with none queued it answers "Done.".
    pub fn push(&self, reply: Reply) {
        self.state.lock().unwrap().replies.push_back(reply);
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
    }

    /// The `POST …/chat/completions` requests received so far.
    pub fn completions(&self) -> Vec<Request> {
        self.requests()
            .into_iter()
            .filter(|r| r.line.starts_with("POST ") && r.line.contains("/chat/completions"))
            .collect()
    }

    /// The last `POST …/chat/completions`; panics when there was none.
    pub fn last_completion(&self) -> Request {
        self.completions()
            .pop()
            .expect("the model was called at least once")
    }

    /// Wait until `n` completions requests have arrived.
    pub async fn wait_completions(&self, n: usize, timeout: Duration) -> Vec<Request> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let requests = self.completions();
            if requests.len() >= n {
                return requests;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the fake model got {} requests, not {n}",
                requests.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Every text in a request's `messages` (system, user, assistant, tool results), one
/// message a line, with assistant tool calls' arguments.
pub fn conversation_text(body: &Value) -> String {
    let mut out = String::new();
    for message in body["messages"].as_array().into_iter().flatten() {
        match &message["content"] {
            Value::String(s) => out.push_str(s),
            Value::Array(parts) => {
                for part in parts {
                    if let Some(t) = part["text"].as_str() {
                        out.push_str(t);
                    }
                }
            }
            _ => {}
        }
        for call in message["tool_calls"].as_array().into_iter().flatten() {
            out.push_str(call["function"]["arguments"].as_str().unwrap_or_default());
        }
        out.push('\n');
    }
    out
}

/// The `messages` of a request with role `role`, as their text.
pub fn messages_of(body: &Value, role: &str) -> Vec<String> {
    body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["role"] == role)
        .map(|m| {
            conversation_text(&json!({"messages": [m]}))
                .trim_end()
                .to_owned()
        })
        .collect()
}

async fn serve(mut stream: TcpStream, state: Arc<Mutex<State>>) {
    let Some((head, body)) = crate::http::read_request(&mut stream).await else {
        return;
    };
    let mut lines = head.lines();
    let line = lines.next().unwrap_or_default().to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            Some((k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        })
        .collect();
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    state.lock().unwrap().requests.push(Request {
        line: line.clone(),
        headers,
        body: body.clone(),
    });
    let path = line.split_whitespace().nth(1).unwrap_or_default();
    let path = path.split('?').next().unwrap_or_default();
    if line.starts_with("GET ") && path.ends_with("/models") {
        let list = json!({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "fake"}
        ]});
        respond_json(&mut stream, &list).await;
        return;
    }
    if !line.starts_with("POST ") || !path.ends_with("/chat/completions") {
        let _ = stream
            .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            .await;
        return;
    }
    let reply = state
        .lock()
        .unwrap()
        .replies
        .pop_front()
        .unwrap_or_else(|| Reply::text("Done."));
    let model = body["model"].as_str().unwrap_or(MODEL).to_owned();
    if body["stream"] != json!(true) {
        respond_json(&mut stream, &whole(&reply, &model)).await;
        return;
    }
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n";
    if stream.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    let pieces = split(&reply.text, reply.chunks);
    let mut frames = vec![chunk(
        &model,
        json!({"role": "assistant", "content": ""}),
        None,
    )];
    if !send_frames(&mut frames, &mut stream).await {
        return;
    }
    for (i, piece) in pieces.iter().enumerate() {
        if i > 0 && !reply.delay.is_zero() {
            tokio::time::sleep(reply.delay).await;
        }
        frames.push(chunk(&model, json!({"content": piece}), None));
        if !send_frames(&mut frames, &mut stream).await {
            return;
        }
    }
    if reply.stall {
        // Held open until the client goes away.
        let mut sink = [0u8; 256];
        while let Ok(n) = stream.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
        return;
    }
    for (index, call) in reply.tool_calls.iter().enumerate() {
        frames.push(chunk(
            &model,
            json!({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}]}),
            None,
        ));
        let arguments = call.arguments.to_string();
        for piece in split(&arguments, 3) {
            frames.push(chunk(
                &model,
                json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}),
                None,
            ));
        }
    }
    let finish = if reply.tool_calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    };
    frames.push(chunk(&model, json!({}), Some(finish)));
    frames.push(json!({
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model,
        "choices": [],
        "usage": usage(&reply),
    }));
    if !send_frames(&mut frames, &mut stream).await {
        return;
    }
    let _ = stream.write_all(b"data: [DONE]\n\n").await;
    let _ = stream.flush().await;
}

/// Write the frames as SSE `data:` lines; false once the client is gone.
async fn send_frames(frames: &mut Vec<Value>, stream: &mut TcpStream) -> bool {
    for frame in frames.drain(..) {
        let text = format!("data: {frame}\n\n");
        if stream.write_all(text.as_bytes()).await.is_err() {
            return false;
        }
    }
    stream.flush().await.is_ok()
}

fn usage(reply: &Reply) -> Value {
    json!({
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    })
}

fn chunk(model: &str, delta: Value, finish: Option<&str>) -> Value {
    json!({
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    })
}

/// A reply as one non-streamed `chat.completion`.
fn whole(reply: &Reply, model: &str) -> Value {
    let calls: Vec<Value> = reply
        .tool_calls
        .iter()
        .map(|c| {
            json!({"id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments.to_string()}})
        })
        .collect();
    let mut message = json!({"role": "assistant", "content": reply.text});
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    json!({
        "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": message,
            "finish_reason": if reply.tool_calls.is_empty() { "stop" } else { "tool_calls" }}],
        "usage": usage(reply),
    })
}

async fn respond_json(stream: &mut TcpStream, value: &Value) {
    let body = value.to_string();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
    let _ = stream.flush().await;
}

/// A text in up to `n` pieces (on char boundaries); none for an empty text.
fn split(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    if chars.is_empty() {
        return Vec::new();
    }
    let step = chars.len().div_ceil(n.max(1)).max(1);
    chars.chunks(step).map(|c| c.iter().collect()).collect()
}
