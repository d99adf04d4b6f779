//! Pi's RPC output, one JSON line at a time, mapped to what the session acts on: events
//! for the timeline, command responses, and dialogs someone has to answer. Pure: no I/O,
//! so recorded transcripts can be replayed through it in tests.
//!
//! - `message_update` text and thinking deltas stream as assistant and reasoning deltas,
//!   under an id per assistant message (Pi's messages carry none); `message_end` closes
//!   the message and adds any text the deltas did not carry, so the deltas always add up
//!   to the whole message. Its `usage` is summed over the turn.
//! - `toolcall_end` announces a call (pending, with its input); `tool_execution_start`
//!   and `tool_execution_end` move it to running and to completed or failed.
//!   `tool_execution_update` (partial output) is not a status change and is dropped.
//! - `agent_end` is the only end of a turn: completed, failed when the last model call
//!   stopped with an error, canceled when it was aborted.
//! - `extension_ui_request` dialogs (`select`, `confirm`, `input`, `editor`) become
//!   `Dialog`s; one from agentry's gate extension names the tool call it is about. The
//!   fire-and-forget methods (`notify`, `setStatus`, …) have nothing to show and are
//!   dropped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::super::{ChangeKind, FileDiff, Location, ProviderEvent, ToolCallUpdate, Usage};
use crate::domain::{ToolKind, ToolStatus, TurnOutcome};

/// What one line of Pi's output asks the session to do.
#[derive(Debug)]
pub enum Action {
    Event(ProviderEvent),
    /// The answer to a command (`id` is ours when we sent one).
    Response {
        id: Option<String>,
        command: String,
        result: Result<Value, String>,
    },
    /// A dialog Pi waits on until it is answered.
    Dialog(Dialog),
}

/// An `extension_ui_request` that expects an `extension_ui_response`.
#[derive(Debug, Clone, PartialEq)]
pub struct Dialog {
    pub id: String,
    pub method: DialogMethod,
    pub title: String,
    pub message: Option<String>,
    /// The choices of a `select`.
    pub options: Vec<String>,
    /// Pi answers the dialog itself after this many milliseconds.
    pub timeout_ms: Option<u64>,
    /// Set when agentry's gate asks about a tool call.
    pub gate: Option<GateCall>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialogMethod {
    Select,
    Confirm,
    Input,
    Editor,
}

/// The tool call a gate dialog is about.
#[derive(Debug, Clone, PartialEq)]
pub struct GateCall {
    pub call_id: String,
    pub tool: String,
    pub input: Value,
}

/// A tool call as far as Pi has described it.
#[derive(Debug, Clone)]
struct Call {
    name: String,
    input: Value,
}

/// The state the mapping keeps between lines.
#[derive(Debug)]
pub struct Mapper {
    /// The workspace, to tell a new file from a changed one and to show relative paths.
    cwd: PathBuf,
    /// Assistant messages seen so far (their ids are `m<n>`).
    messages: u64,
    /// The text the current message's deltas carried.
    streamed: String,
    calls: HashMap<String, Call>,
    /// The turn's usage so far; `None` until a model call reports some.
    usage: Option<Usage>,
    /// The model's context window, when known.
    context_window: Option<u64>,
    /// How the turn's last model call stopped, with its error message.
    last_stop: Option<(String, Option<String>)>,
}

impl Mapper {
    pub fn new(cwd: impl Into<PathBuf>) -> Self {
        Self {
            cwd: cwd.into(),
            messages: 0,
            streamed: String::new(),
            calls: HashMap::new(),
            usage: None,
            context_window: None,
            last_stop: None,
        }
    }

    fn message_id(&self) -> String {
        format!("m{}", self.messages)
    }

    /// Map one line of output.
    pub fn map(&mut self, line: &Value) -> Vec<Action> {
        let kind = line.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "response" => {
                // The model's context window, from the state and from a model change.
                let model = match line["command"].as_str() {
                    Some("get_state") => &line["data"]["model"],
                    Some("set_model") => &line["data"],
                    _ => &Value::Null,
                };
                if let Some(window) = model.get("contextWindow").and_then(Value::as_u64) {
                    self.context_window = Some(window);
                }
                vec![response(line)]
            }
            "agent_start" => {
                self.usage = None;
                self.last_stop = None;
                self.calls.clear();
                Vec::new()
            }
            "message_start" if role(line) == Some("assistant") => {
                self.messages += 1;
                self.streamed.clear();
                Vec::new()
            }
            "message_update" => self.update(line),
            "message_end" if role(line) == Some("assistant") => self.message_end(&line["message"]),
            "tool_execution_start" => self.tool_start(line),
            "tool_execution_end" => self.tool_end(line),
            "agent_end" => vec![self.agent_end()],
            "extension_ui_request" => self.dialog(line).map(Action::Dialog).into_iter().collect(),
            "extension_error" => vec![Action::Event(ProviderEvent::Error {
                message: format!(
                    "a Pi extension failed ({}): {}",
                    text_of(&line["extensionPath"]),
                    text_of(&line["error"])
                ),
                code: Some("extension_error".to_owned()),
            })],
            "auto_retry_start" => vec![Action::Event(ProviderEvent::Error {
                message: format!(
                    "the model call failed and is retried (attempt {} of {}): {}",
                    line["attempt"],
                    line["maxAttempts"],
                    text_of(&line["errorMessage"])
                ),
                code: Some("provider_retry".to_owned()),
            })],
            _ => Vec::new(),
        }
    }

    fn update(&mut self, line: &Value) -> Vec<Action> {
        let event = &line["assistantMessageEvent"];
        match event
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
        {
            "text_delta" => {
                let delta = text_of(&event["delta"]);
                if delta.is_empty() {
                    return Vec::new();
                }
                self.streamed.push_str(&delta);
                vec![Action::Event(ProviderEvent::AssistantDelta {
                    message_id: Some(self.message_id()),
                    text: delta,
                })]
            }
            "thinking_delta" => {
                let delta = text_of(&event["delta"]);
                if delta.is_empty() {
                    return Vec::new();
                }
                vec![Action::Event(ProviderEvent::ReasoningDelta {
                    id: Some(format!("{}-thinking", self.message_id())),
                    text: delta,
                })]
            }
            "toolcall_end" => {
                let call = &event["toolCall"];
                let Some(id) = call.get("id").and_then(Value::as_str) else {
                    return Vec::new();
                };
                let input = call.get("arguments").cloned().unwrap_or(Value::Null);
                self.call_seen(id, text_of(&call["name"]), input, ToolStatus::Pending)
            }
            _ => Vec::new(),
        }
    }

    fn message_end(&mut self, message: &Value) -> Vec<Action> {
        let mut out = Vec::new();
        let whole: String = message["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["type"] == "text")
            .map(|c| text_of(&c["text"]))
            .collect();
        // A provider that did not stream (or streamed only part) still gets its whole
        // text out, as the deltas that were missing.
        if let Some(rest) = whole.strip_prefix(self.streamed.as_str())
            && !rest.is_empty()
        {
            out.push(Action::Event(ProviderEvent::AssistantDelta {
                message_id: Some(self.message_id()),
                text: rest.to_owned(),
            }));
        }
        self.streamed.clear();
        let stop = text_of(&message["stopReason"]);
        let error = message
            .get("errorMessage")
            .and_then(Value::as_str)
            .map(str::to_owned);
        self.last_stop = Some((stop, error));
        if let Some(call) = message.get("usage").filter(|u| u.is_object()) {
            let n = |k: &str| call.get(k).and_then(Value::as_u64).unwrap_or(0);
            let (input, output, read, write) =
                (n("input"), n("output"), n("cacheRead"), n("cacheWrite"));
            if input + output + read + write > 0 {
                let usage = self.usage.get_or_insert_with(Usage::default);
                usage.input_tokens += input + read + write;
                usage.output_tokens += output;
                usage.cached_input_tokens += read;
                usage.cache_write_tokens += write;
                usage.context_window_used = Some(input + read + write + output);
                usage.context_window_max = self.context_window;
                if let Some(cost) = call["cost"]["total"].as_f64().filter(|c| *c > 0.0) {
                    *usage.cost_usd.get_or_insert(0.0) += cost;
                }
                out.push(Action::Event(ProviderEvent::Usage(usage.clone())));
            }
        }
        out
    }

    fn tool_start(&mut self, line: &Value) -> Vec<Action> {
        let Some(id) = line.get("toolCallId").and_then(Value::as_str) else {
            return Vec::new();
        };
        let input = line.get("args").cloned().unwrap_or(Value::Null);
        self.call_seen(id, text_of(&line["toolName"]), input, ToolStatus::Running)
    }

    /// Call `id` is known (its name and input kept for its later updates): its update.
    fn call_seen(
        &mut self,
        id: &str,
        name: String,
        input: Value,
        status: ToolStatus,
    ) -> Vec<Action> {
        self.calls.insert(
            id.to_owned(),
            Call {
                name: name.clone(),
                input: input.clone(),
            },
        );
        vec![Action::Event(ProviderEvent::ToolCall(
            self.tool_update(id, &name, input, status),
        ))]
    }

    fn tool_end(&mut self, line: &Value) -> Vec<Action> {
        let Some(id) = line.get("toolCallId").and_then(Value::as_str) else {
            return Vec::new();
        };
        let call = self.calls.remove(id);
        let name = call
            .as_ref()
            .map(|c| c.name.clone())
            .unwrap_or_else(|| text_of(&line["toolName"]));
        let input = call.map(|c| c.input).unwrap_or(Value::Null);
        let failed = line["isError"] == Value::Bool(true);
        let text: String = line["result"]["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["type"] == "text")
            .map(|c| text_of(&c["text"]))
            .collect::<Vec<_>>()
            .join("\n");
        let status = if failed {
            ToolStatus::Failed
        } else {
            ToolStatus::Completed
        };
        let mut update = self.tool_update(id, &name, input, status);
        // An edit says where its change starts.
        if let (Some(line), Some(location)) = (
            line["result"]["details"]["firstChangedLine"].as_u64(),
            update.locations.first_mut(),
        ) {
            location.line = Some(line);
        }
        update.output = Some(Value::String(text.clone()));
        if failed {
            update.error = Some(text);
        }
        vec![Action::Event(ProviderEvent::ToolCall(update))]
    }

    fn agent_end(&mut self) -> Action {
        self.calls.clear();
        let (outcome, error) = match self.last_stop.take() {
            Some((stop, _)) if stop == "aborted" => (TurnOutcome::Canceled, None),
            Some((stop, error)) if stop == "error" => (
                TurnOutcome::Failed,
                Some(error.unwrap_or_else(|| "the model call failed".to_owned())),
            ),
            _ => (TurnOutcome::Completed, None),
        };
        Action::Event(ProviderEvent::TurnEnded {
            outcome,
            error,
            usage: self.usage.take(),
        })
    }

    fn dialog(&self, line: &Value) -> Option<Dialog> {
        let method = match line.get("method").and_then(Value::as_str)? {
            "select" => DialogMethod::Select,
            "confirm" => DialogMethod::Confirm,
            "input" => DialogMethod::Input,
            "editor" => DialogMethod::Editor,
            _ => return None,
        };
        let id = line.get("id").and_then(Value::as_str)?.to_owned();
        let message = line
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let gate = (method == DialogMethod::Confirm)
            .then(|| message.as_deref().and_then(|m| self.gate_call(m)))
            .flatten();
        Some(Dialog {
            id,
            method,
            title: text_of(&line["title"]),
            message: if gate.is_some() { None } else { message },
            options: line["options"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|o| o.as_str().map(str::to_owned))
                .collect(),
            timeout_ms: line.get("timeout").and_then(Value::as_u64),
            gate,
        })
    }

    /// The tool call named by a gate marker (`{"agentry_gate":1,"toolCallId":…}`).
    fn gate_call(&self, message: &str) -> Option<GateCall> {
        let marker: Value = serde_json::from_str(message).ok()?;
        marker.get("agentry_gate")?;
        let call_id = marker.get("toolCallId").and_then(Value::as_str)?.to_owned();
        let known = self.calls.get(&call_id);
        Some(GateCall {
            tool: known
                .map(|c| c.name.clone())
                .unwrap_or_else(|| text_of(&marker["toolName"])),
            input: known.map(|c| c.input.clone()).unwrap_or(Value::Null),
            call_id,
        })
    }

    /// A `tool_call` for Pi's tool `name` (its built-ins: read, bash, edit, write, grep,
    /// find, ls) with what can be told from its input.
    pub fn tool_update(
        &self,
        id: &str,
        name: &str,
        input: Value,
        status: ToolStatus,
    ) -> ToolCallUpdate {
        let kind = tool_kind(name);
        let path = input.get("path").and_then(Value::as_str).map(str::to_owned);
        let mut update = ToolCallUpdate::new(id, name, kind, status, input.clone());
        if let Some(path) = &path {
            update.title = format!("{name} {path}");
            update.locations.push(Location {
                path: path.clone(),
                line: None,
            });
        } else if let Some(command) = input.get("command").and_then(Value::as_str) {
            update.title = format!("{name} {command}");
        }
        if name == "write"
            && let (Some(path), Some(content)) =
                (&path, input.get("content").and_then(Value::as_str))
            && !status.is_final()
        {
            let exists = resolve(&self.cwd, path).exists();
            update.diff.push(FileDiff {
                path: path.clone(),
                change: if exists {
                    ChangeKind::Modify
                } else {
                    ChangeKind::Add
                },
                move_path: None,
                unified: None,
                old_text: None,
                new_text: Some(content.to_owned()),
            });
        }
        update
    }
}

fn resolve(cwd: &Path, path: &str) -> PathBuf {
    let p = Path::new(path);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        cwd.join(p)
    }
}

/// What kind of tool Pi's `name` is.
pub fn tool_kind(name: &str) -> ToolKind {
    match name {
        "bash" => ToolKind::Shell,
        "read" => ToolKind::Read,
        "edit" => ToolKind::Edit,
        "write" => ToolKind::Write,
        "grep" | "find" | "ls" => ToolKind::Search,
        _ => ToolKind::Other,
    }
}

fn role(line: &Value) -> Option<&str> {
    line["message"]["role"].as_str()
}

fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn response(line: &Value) -> Action {
    let id = line.get("id").and_then(Value::as_str).map(str::to_owned);
    let command = text_of(&line["command"]);
    let result = if line["success"] == Value::Bool(true) {
        Ok(line.get("data").cloned().unwrap_or(Value::Null))
    } else {
        Err(line
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("the command failed")
            .to_owned())
    };
    Action::Response {
        id,
        command,
        result,
    }
}
