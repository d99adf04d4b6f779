//! A fake Anthropic Messages API on 127.0.0.1 for driving the real Claude Code CLI:
//! `POST /v1/messages` streams scripted replies as SSE, `POST /v1/messages/count_tokens`,
//! `GET /v1/models` and `HEAD /api/hello` answer what the CLI expects. Each test queues
//! the model's replies and reads back the requests it received.
//!
//! Served by the shared loop and SSE writer of `http.rs`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::net::TcpStream;

use crate::http::{Request, Server, Sse, pieces, respond_empty, respond_json};

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
    _server: Server,
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

async fn serve(request: Request, mut stream: TcpStream, state: Arc<Mutex<State>>) {
    state.lock().unwrap().lines.push(request.line.clone());
    match (request.method.as_str(), request.path.as_str()) {
        ("POST", "/v1/messages") => {
            let body = request.json();
            let (reply, number) = {
                let mut s = state.lock().unwrap();
                s.api_keys
                    .push(request.header("x-api-key").unwrap_or_default().to_owned());
                s.message_no += 1;
                let reply = match (s.replies.pop_front(), &s.responder) {
                    (Some(queued), _) => queued,
                    (None, Some(respond)) => respond(&body),
                    (None, None) => Reply::text("Done."),
                };
                s.requests.push(body);
                (reply, s.message_no)
            };
            let _ = stream_reply(stream, &reply, number).await;
        }
        ("POST", "/v1/messages/count_tokens") => {
            respond_json(&mut stream, &json!({"input_tokens": 42})).await;
        }
        ("GET", "/v1/models") => {
            respond_json(
                &mut stream,
                &json!({"data": [{"type": "model", "id": "fake-model-1",
                    "display_name": "Fake model", "created_at": "2026-01-01T00:00:00Z"}],
                    "has_more": false, "first_id": "fake-model-1", "last_id": "fake-model-1"}),
            )
            .await;
        }
        ("HEAD", _) => respond_empty(&mut stream, "200 OK").await,
        _ => respond_empty(&mut stream, "404 Not Found").await,
    }
}

/// One Messages stream event, named by its `type`.
async fn event(sse: &mut Sse, data: Value) -> std::io::Result<()> {
    let kind = data["type"].as_str().unwrap_or("ping").to_owned();
    sse.event(&kind, &data).await
}

async fn stream_reply(stream: TcpStream, reply: &Reply, number: u64) -> std::io::Result<()> {
    let mut sse = Sse::start(stream).await?;
    let id = format!("msg_fake{number:04}");
    event(
        &mut sse,
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
                    &mut sse,
                    json!({"type": "content_block_start", "index": index,
                    "content_block": {"type": "text", "text": ""}}),
                )
                .await?;
                for piece in pieces(text, reply.chunks) {
                    sse.pause(reply.delay).await;
                    event(
                        &mut sse,
                        json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": piece}}),
                    )
                    .await?;
                }
            }
            Block::Thinking(text) => {
                event(
                    &mut sse,
                    json!({"type": "content_block_start", "index": index,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
                )
                .await?;
                for piece in pieces(text, reply.chunks) {
                    event(
                        &mut sse,
                        json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "thinking_delta", "thinking": piece}}),
                    )
                    .await?;
                }
                event(
                    &mut sse,
                    json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "signature_delta", "signature": "c2ln"}}),
                )
                .await?;
            }
            Block::ToolUse { id, name, input } => {
                stop_reason = "tool_use";
                event(
                    &mut sse,
                    json!({"type": "content_block_start", "index": index,
                    "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
                )
                .await?;
                event(
                    &mut sse,
                    json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
                )
                .await?;
            }
        }
        event(
            &mut sse,
            json!({"type": "content_block_stop", "index": index}),
        )
        .await?;
    }
    event(
        &mut sse,
        json!({"type": "message_delta", "delta": {"stop_reason": stop_reason,
            "stop_sequence": null}, "usage": {"output_tokens": 15}}),
    )
    .await?;
    event(&mut sse, json!({"type": "message_stop"})).await?;
    sse.end().await
}
