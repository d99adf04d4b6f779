//! A fake OpenAI Chat Completions API on 127.0.0.1 for driving real agent CLIs that speak
//! it (Copilot's BYOK provider, OpenCode, Pi): `POST /v1/chat/completions` with
//! `stream: true` answers the next scripted reply as `chat.completion.chunk` server-sent
//! events — text in `delta.content`, tool calls in `delta.tool_calls` with their arguments
//! streamed in pieces, a `finish_reason`, a last chunk with `usage`, then `data: [DONE]`;
//! a request without `stream` gets one whole `chat.completion`. `GET /v1/models` lists
//! the model. Every request is recorded (path, headers, body) for the test to read.
//!
//! Served by the shared loop and SSE writer of `http.rs`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::net::TcpStream;

use crate::http::{Server, Sse, pieces, respond_empty, respond_json};

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
    _server: Server,
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
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let server =
            Server::start(move |request, stream| serve(request, stream, shared.clone())).await;
        Self {
            port: server.addr.port(),
            state,
            _server: server,
        }
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

    /// The last completion was streamed, for [`MODEL`], with the key `test-key`; and the
    /// CLI asked nothing but the model endpoint (`/v1/…`), as offline.
    pub fn assert_streamed_offline(&self) {
        let request = self.last_completion();
        assert_eq!(request.body["stream"], true);
        assert_eq!(request.body["model"], MODEL);
        assert_eq!(request.header("authorization"), Some("Bearer test-key"));
        for r in self.requests() {
            assert!(r.line.contains("/v1/"), "{}", r.line);
        }
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

async fn serve(request: crate::http::Request, mut stream: TcpStream, state: Arc<Mutex<State>>) {
    let body = request.json();
    state.lock().unwrap().requests.push(Request {
        line: request.line.clone(),
        headers: request.headers.clone(),
        body: body.clone(),
    });
    let path = request.path.as_str();
    if request.method == "GET" && path.ends_with("/models") {
        let list = json!({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "fake"}
        ]});
        respond_json(&mut stream, &list).await;
        return;
    }
    if request.method != "POST" || !path.ends_with("/chat/completions") {
        respond_empty(&mut stream, "404 Not Found").await;
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
    let _ = stream_reply(stream, &reply, &model).await;
}

async fn stream_reply(stream: TcpStream, reply: &Reply, model: &str) -> std::io::Result<()> {
    let mut sse = Sse::start(stream).await?;
    sse.data(&chunk(
        model,
        json!({"role": "assistant", "content": ""}),
        None,
    ))
    .await?;
    for (i, piece) in pieces(&reply.text, reply.chunks).iter().enumerate() {
        if i > 0 {
            sse.pause(reply.delay).await;
        }
        sse.data(&chunk(model, json!({"content": piece}), None))
            .await?;
    }
    if reply.stall {
        sse.stall().await;
        return Ok(());
    }
    for (index, call) in reply.tool_calls.iter().enumerate() {
        sse.data(&chunk(
            model,
            json!({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}]}),
            None,
        ))
        .await?;
        for piece in pieces(&call.arguments.to_string(), 3) {
            sse.data(&chunk(
                model,
                json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}),
                None,
            ))
            .await?;
        }
    }
    let finish = if reply.tool_calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    };
    sse.data(&chunk(model, json!({}), Some(finish))).await?;
    sse.data(&json!({
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model,
        "choices": [],
        "usage": usage(reply),
    }))
    .await?;
    sse.send(None, "[DONE]").await
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
