//! A fake OpenAI Responses endpoint for driving the real Codex CLI: `POST /v1/responses`
//! on 127.0.0.1 streams the next scripted reply as server-sent events and records every
//! request body. Served by the shared loop and SSE writer of `http.rs`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::net::TcpStream;

use crate::http::{Request, Server, Sse, pieces, respond_empty};

/// One output item of a scripted model reply.
#[derive(Debug, Clone)]
pub enum Item {
    /// Assistant text, streamed in a few deltas.
    Text(String),
    /// A reasoning summary, streamed.
    Reasoning(String),
    /// An `exec_command` function call running `cmd`; `escalate` asks to run it outside
    /// the sandbox.
    Exec {
        call_id: String,
        cmd: String,
        escalate: bool,
    },
    /// An `apply_patch` custom tool call with this patch text.
    Patch { call_id: String, patch: String },
}

/// A scripted reply: its items, then `response.completed` with usage, unless it stalls.
#[derive(Debug, Clone)]
pub struct Reply {
    pub items: Vec<Item>,
    /// Stream the items, then keep the response open without completing it.
    pub stall: bool,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl Reply {
    pub fn new(items: Vec<Item>) -> Self {
        Self {
            items,
            stall: false,
            input_tokens: 100,
            output_tokens: 20,
        }
    }

    pub fn text(text: &str) -> Self {
        Self::new(vec![Item::Text(text.to_owned())])
    }

    pub fn exec(call_id: &str, cmd: &str) -> Self {
        Self::new(vec![Item::Exec {
            call_id: call_id.to_owned(),
            cmd: cmd.to_owned(),
            escalate: false,
        }])
    }

    /// A command the model asks to run outside the sandbox (so it needs an approval).
    pub fn exec_escalated(call_id: &str, cmd: &str) -> Self {
        Self::new(vec![Item::Exec {
            call_id: call_id.to_owned(),
            cmd: cmd.to_owned(),
            escalate: true,
        }])
    }

    pub fn patch(call_id: &str, patch: &str) -> Self {
        Self::new(vec![Item::Patch {
            call_id: call_id.to_owned(),
            patch: patch.to_owned(),
        }])
    }

    /// Text that begins to stream and never ends.
    pub fn stalled(text: &str) -> Self {
        Self {
            stall: true,
            ..Self::text(text)
        }
    }
}

#[derive(Default)]
struct State {
    replies: VecDeque<Reply>,
    requests: Vec<Value>,
    authorizations: Vec<String>,
}

/// The fake server; it stops when dropped.
pub struct FakeOpenAi {
    pub port: u16,
    state: Arc<Mutex<State>>,
    _server: Server,
}

impl crate::cli_world::ModelFake for FakeOpenAi {
    fn launch() -> impl std::future::Future<Output = Self> {
        Self::start()
    }
    fn endpoint(&self) -> String {
        self.base_url()
    }
}

impl FakeOpenAi {
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

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// Queue replies, served in order; with none queued the model answers "Done.".
    pub fn script(&self, replies: impl IntoIterator<Item = Reply>) {
        self.state.lock().unwrap().replies.extend(replies);
    }

    /// Every request body received so far.
    pub fn requests(&self) -> Vec<Value> {
        self.state.lock().unwrap().requests.clone()
    }

    /// The `Authorization` header of every request received so far (empty when absent).
    pub fn authorizations(&self) -> Vec<String> {
        self.state.lock().unwrap().authorizations.clone()
    }

    /// Wait until `n` requests have arrived.
    pub async fn wait_requests(&self, n: usize, timeout: Duration) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let requests = self.requests();
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

/// The text of every item of a request's `input`, flattened (messages, tool outputs).
pub fn input_text(request: &Value) -> String {
    let mut out = String::new();
    for item in request["input"].as_array().into_iter().flatten() {
        match item["type"].as_str() {
            Some("function_call_output" | "custom_tool_call_output") => {
                out.push_str(&item["output"].to_string());
            }
            _ => {
                for part in item["content"].as_array().into_iter().flatten() {
                    if let Some(t) = part["text"].as_str() {
                        out.push_str(t);
                    }
                }
            }
        }
        out.push('\n');
    }
    out
}

async fn serve(request: Request, mut stream: TcpStream, state: Arc<Mutex<State>>) {
    let authorization = request
        .header("authorization")
        .unwrap_or_default()
        .to_owned();
    state.lock().unwrap().authorizations.push(authorization);
    if request.method != "POST" || !request.path.contains("/responses") {
        respond_empty(&mut stream, "404 Not Found").await;
        return;
    }
    let reply = {
        let mut state = state.lock().unwrap();
        state.requests.push(request.json());
        state
            .replies
            .pop_front()
            .unwrap_or_else(|| Reply::text("Done."))
    };
    let _ = stream_reply(stream, &reply).await;
}

async fn stream_reply(stream: TcpStream, reply: &Reply) -> std::io::Result<()> {
    let mut sse = Sse::start(stream).await?;
    for (event, data) in events(reply) {
        sse.event(&event, &data).await?;
    }
    if reply.stall {
        sse.stall().await;
    }
    Ok(())
}

/// The SSE events of a reply, as (event type, JSON data).
fn events(reply: &Reply) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut push = |kind: &str, mut data: Value| {
        data["type"] = json!(kind);
        out.push((kind.to_owned(), data));
    };
    push("response.created", json!({"response": {"id": "resp_1"}}));
    for (index, item) in reply.items.iter().enumerate() {
        match item {
            Item::Text(text) => {
                let id = format!("msg_{index}");
                push(
                    "response.output_item.added",
                    json!({"output_index": index, "item": {"type": "message", "id": id, "role": "assistant", "content": []}}),
                );
                for delta in pieces(text, 3) {
                    push(
                        "response.output_text.delta",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta}),
                    );
                }
                if !reply.stall {
                    push(
                        "response.output_item.done",
                        json!({"output_index": index, "item": {"type": "message", "id": id, "role": "assistant", "content": [{"type": "output_text", "text": text}]}}),
                    );
                }
            }
            Item::Reasoning(text) => {
                let id = format!("rs_{index}");
                push(
                    "response.output_item.added",
                    json!({"output_index": index, "item": {"type": "reasoning", "id": id, "summary": []}}),
                );
                push(
                    "response.reasoning_summary_part.added",
                    json!({"item_id": id, "output_index": index, "summary_index": 0, "part": {"type": "summary_text", "text": ""}}),
                );
                for delta in pieces(text, 3) {
                    push(
                        "response.reasoning_summary_text.delta",
                        json!({"item_id": id, "output_index": index, "summary_index": 0, "delta": delta}),
                    );
                }
                push(
                    "response.output_item.done",
                    json!({"output_index": index, "item": {"type": "reasoning", "id": id, "summary": [{"type": "summary_text", "text": text}]}}),
                );
            }
            Item::Exec {
                call_id,
                cmd,
                escalate,
            } => {
                let mut arguments = json!({"cmd": cmd});
                if *escalate {
                    arguments["sandbox_permissions"] = json!("require_escalated");
                    arguments["justification"] = json!("The file must be written.");
                }
                let arguments = arguments.to_string();
                let id = format!("fc_{index}");
                push(
                    "response.output_item.added",
                    json!({"output_index": index, "item": {"type": "function_call", "id": id, "call_id": call_id, "name": "exec_command", "arguments": ""}}),
                );
                push(
                    "response.output_item.done",
                    json!({"output_index": index, "item": {"type": "function_call", "id": id, "call_id": call_id, "name": "exec_command", "arguments": arguments}}),
                );
            }
            Item::Patch { call_id, patch } => {
                let id = format!("ctc_{index}");
                push(
                    "response.output_item.added",
                    json!({"output_index": index, "item": {"type": "custom_tool_call", "id": id, "call_id": call_id, "name": "apply_patch", "input": ""}}),
                );
                push(
                    "response.output_item.done",
                    json!({"output_index": index, "item": {"type": "custom_tool_call", "id": id, "call_id": call_id, "name": "apply_patch", "input": patch}}),
                );
            }
        }
    }
    if !reply.stall {
        push(
            "response.completed",
            json!({"response": {"id": "resp_1", "usage": {
                "input_tokens": reply.input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": reply.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": reply.input_tokens + reply.output_tokens,
            }}}),
        );
    }
    out
}
