//! Claude Code's stdout, one JSON message at a time, turned into what the session does
//! next: events for the runtime, permission requests to raise, control responses to
//! route. Pure (no I/O), so recorded transcripts can drive it in tests.

use std::collections::{HashMap, HashSet};

use serde_json::{Value, json};

use crate::domain::{PermissionKind, ToolKind, ToolStatus, TurnOutcome};
use crate::providers::{ChangeKind, FileDiff, Location, ProviderEvent, ToolCallUpdate, Usage};

/// What one stdout message asks of the session.
#[derive(Debug)]
pub enum Action {
    /// Hand this to the runtime (never a `PermissionRequested`: see `Permission`).
    Event(ProviderEvent),
    /// `can_use_tool`: raise a permission request and answer it later.
    Permission(ToolPermission),
    /// The answer to one of our control requests.
    ControlResponse {
        request_id: String,
        result: Result<Value, String>,
    },
    /// The CLI no longer waits for the answer to its request `request_id`.
    Withdrawn { request_id: String },
    /// A control request we do not serve; it must be answered with an error.
    Unsupported { request_id: String, subtype: String },
    /// The CLI reported its permission mode (it may be the one already known).
    ModeReported(String),
}

/// A `can_use_tool` request.
#[derive(Debug, Clone)]
pub struct ToolPermission {
    pub request_id: String,
    pub tool_name: String,
    pub call_id: Option<String>,
    pub input: Value,
    pub title: String,
    pub kind: PermissionKind,
    /// What "always allow" would add (`permission_suggestions`), when the CLI offers it.
    pub suggestions: Option<Value>,
}

/// The state carried from one message to the next.
pub struct Mapper {
    session_id: String,
    /// Assistant messages whose text arrived as deltas (the whole block is then dropped).
    streamed_text: HashSet<String>,
    streamed_thinking: HashSet<String>,
    /// Tool calls by id, so that results complete what `tool_use` began.
    tools: HashMap<String, ToolCallUpdate>,
    /// Usage of the latest model call, for the context window in use.
    last_call: Option<Value>,
    /// The session's handle is not known to the runtime yet: report it at the first
    /// `system/init` (the CLI keeps a conversation only once it got a prompt).
    announce: bool,
}

impl Mapper {
    pub fn new(session_id: impl Into<String>) -> Self {
        Self {
            session_id: session_id.into(),
            streamed_text: HashSet::new(),
            streamed_thinking: HashSet::new(),
            tools: HashMap::new(),
            last_call: None,
            announce: false,
        }
    }

    /// For a new session: its id is reported (as `SessionUpdated`) at the first
    /// `system/init`, when the CLI has a conversation to reopen.
    pub fn announcing(mut self) -> Self {
        self.announce = true;
        self
    }

    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// Map one stdout message.
    pub fn map(&mut self, message: &Value) -> Vec<Action> {
        let kind = str_at(message, "type").unwrap_or_default();
        match kind {
            "stream_event" => self.stream_event(message),
            "assistant" => self.assistant(message),
            "user" => self.user(message),
            "result" => self.result(message),
            "system" => self.system(message),
            "control_request" => control_request(message),
            "control_response" => control_response(message),
            "control_cancel_request" => match str_at(message, "request_id") {
                Some(id) => vec![Action::Withdrawn {
                    request_id: id.to_owned(),
                }],
                None => Vec::new(),
            },
            other => {
                tracing::trace!(kind = other, "ignoring a Claude Code message");
                Vec::new()
            }
        }
    }

    fn stream_event(&mut self, message: &Value) -> Vec<Action> {
        if is_subagent(message) {
            return Vec::new();
        }
        let Some(event) = message.get("event") else {
            return Vec::new();
        };
        let message_id = str_at(message, "api_message_id").map(str::to_owned);
        match str_at(event, "type").unwrap_or_default() {
            "message_start" => {
                if let Some(usage) = event.pointer("/message/usage") {
                    self.last_call = Some(usage.clone());
                }
                Vec::new()
            }
            "message_delta" => {
                if let (Some(last), Some(out)) = (
                    self.last_call.as_mut(),
                    event.pointer("/usage/output_tokens"),
                ) {
                    last["output_tokens"] = out.clone();
                }
                Vec::new()
            }
            "content_block_delta" => {
                let delta = &event["delta"];
                match str_at(delta, "type").unwrap_or_default() {
                    "text_delta" => {
                        let Some(text) = str_at(delta, "text").filter(|t| !t.is_empty()) else {
                            return Vec::new();
                        };
                        if let Some(id) = &message_id {
                            self.streamed_text.insert(id.clone());
                        }
                        vec![Action::Event(ProviderEvent::AssistantDelta {
                            message_id,
                            text: text.to_owned(),
                        })]
                    }
                    "thinking_delta" => {
                        let Some(text) = str_at(delta, "thinking").filter(|t| !t.is_empty()) else {
                            return Vec::new();
                        };
                        if let Some(id) = &message_id {
                            self.streamed_thinking.insert(id.clone());
                        }
                        vec![Action::Event(ProviderEvent::ReasoningDelta {
                            id: message_id,
                            text: text.to_owned(),
                        })]
                    }
                    _ => Vec::new(),
                }
            }
            _ => Vec::new(),
        }
    }

    fn assistant(&mut self, message: &Value) -> Vec<Action> {
        let subagent = is_subagent(message);
        let parent = str_at(message, "parent_tool_use_id").map(str::to_owned);
        let message_id = message
            .pointer("/message/id")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let Some(blocks) = message
            .pointer("/message/content")
            .and_then(Value::as_array)
        else {
            return Vec::new();
        };
        let mut actions = Vec::new();
        for block in blocks {
            match str_at(block, "type").unwrap_or_default() {
                "text" if !subagent => {
                    let streamed = message_id
                        .as_ref()
                        .is_some_and(|id| self.streamed_text.contains(id));
                    if let Some(text) = str_at(block, "text").filter(|t| !t.is_empty())
                        && !streamed
                    {
                        actions.push(Action::Event(ProviderEvent::AssistantMessage {
                            message_id: message_id.clone(),
                            text: text.to_owned(),
                        }));
                    }
                }
                "thinking" if !subagent => {
                    let streamed = message_id
                        .as_ref()
                        .is_some_and(|id| self.streamed_thinking.contains(id));
                    if let Some(text) = str_at(block, "thinking").filter(|t| !t.is_empty())
                        && !streamed
                    {
                        actions.push(Action::Event(ProviderEvent::ReasoningDelta {
                            id: message_id.clone(),
                            text: text.to_owned(),
                        }));
                    }
                }
                "tool_use" => {
                    let Some(id) = str_at(block, "id") else {
                        continue;
                    };
                    let name = str_at(block, "name").unwrap_or("tool");
                    let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                    let mut call = tool_call(id, name, input);
                    call.parent_call_id = parent.clone();
                    self.tools.insert(id.to_owned(), call.clone());
                    actions.push(Action::Event(ProviderEvent::ToolCall(call)));
                }
                _ => {}
            }
        }
        actions
    }

    fn user(&mut self, message: &Value) -> Vec<Action> {
        let Some(blocks) = message
            .pointer("/message/content")
            .and_then(Value::as_array)
        else {
            // A plain string is the echo of a prompt (the runtime owns those).
            return Vec::new();
        };
        let rich = message.get("tool_use_result");
        let mut actions = Vec::new();
        for block in blocks {
            if str_at(block, "type") != Some("tool_result") {
                continue;
            }
            let Some(id) = str_at(block, "tool_use_id") else {
                continue;
            };
            let mut call = self.tools.remove(id).unwrap_or_else(|| {
                ToolCallUpdate::new(id, "tool", ToolKind::Other, ToolStatus::Running, json!({}))
            });
            let failed = block
                .get("is_error")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let text = result_text(block.get("content"));
            call.status = if failed {
                ToolStatus::Failed
            } else {
                ToolStatus::Completed
            };
            call.error = failed.then(|| text.clone().unwrap_or_else(|| "the tool failed".into()));
            call.output = match rich {
                Some(r) if r.is_object() => Some(r.clone()),
                _ => text.map(Value::String),
            };
            if let Some(diffs) = rich.and_then(patch_diffs) {
                call.diff = diffs;
            }
            actions.push(Action::Event(ProviderEvent::ToolCall(call)));
        }
        actions
    }

    fn result(&mut self, message: &Value) -> Vec<Action> {
        self.tools.clear();
        self.streamed_text.clear();
        self.streamed_thinking.clear();
        let usage = self.usage(message);
        let subtype = str_at(message, "subtype").unwrap_or("success");
        let is_error = message
            .get("is_error")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let (outcome, error) = if subtype == "success" && !is_error {
            (TurnOutcome::Completed, None)
        } else {
            (TurnOutcome::Failed, Some(result_error(message, subtype)))
        };
        let mut actions = Vec::new();
        if let Some(usage) = &usage {
            actions.push(Action::Event(ProviderEvent::Usage(usage.clone())));
        }
        actions.push(Action::Event(ProviderEvent::TurnEnded {
            outcome,
            error,
            usage,
        }));
        actions
    }

    /// The turn's usage from a `result`: its token counts, its cost and the context
    /// window of the model it used.
    fn usage(&mut self, message: &Value) -> Option<Usage> {
        let u = message.get("usage")?;
        let n = |v: &Value, key: &str| v.get(key).and_then(Value::as_u64).unwrap_or(0);
        let cache_read = n(u, "cache_read_input_tokens");
        let cache_write = n(u, "cache_creation_input_tokens");
        let per_model = message
            .get("model_usage_since_last_result")
            .or_else(|| message.get("modelUsage"))
            .and_then(Value::as_object);
        let context_window_max = per_model.and_then(|models| {
            models
                .values()
                .filter_map(|m| m.get("contextWindow").and_then(Value::as_u64))
                .max()
        });
        let cost_usd = match message.get("model_usage_since_last_result") {
            Some(Value::Object(models)) => Some(
                models
                    .values()
                    .filter_map(|m| m.get("costUSD").and_then(Value::as_f64))
                    .sum(),
            ),
            _ => message.get("total_cost_usd").and_then(Value::as_f64),
        };
        let context_window_used = self.last_call.take().map(|last| {
            n(&last, "input_tokens")
                + n(&last, "cache_read_input_tokens")
                + n(&last, "cache_creation_input_tokens")
                + n(&last, "output_tokens")
        });
        Some(Usage {
            input_tokens: n(u, "input_tokens") + cache_read + cache_write,
            output_tokens: n(u, "output_tokens"),
            cached_input_tokens: cache_read,
            cache_write_tokens: cache_write,
            reasoning_tokens: u
                .pointer("/output_tokens_details/thinking_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            context_window_max,
            context_window_used,
            cost_usd,
        })
    }

    fn system(&mut self, message: &Value) -> Vec<Action> {
        let mut actions = Vec::new();
        match str_at(message, "subtype") {
            Some("init") => {
                if let Some(id) = str_at(message, "session_id")
                    && !id.is_empty()
                    && (id != self.session_id || self.announce)
                {
                    self.announce = false;
                    self.session_id = id.to_owned();
                    actions.push(Action::Event(ProviderEvent::SessionUpdated {
                        provider_session_id: Some(id.to_owned()),
                        persistence: Some(json!({ "session_id": id })),
                    }));
                }
                if let Some(mode) = str_at(message, "permissionMode") {
                    actions.push(Action::ModeReported(mode.to_owned()));
                }
            }
            Some("status") => {
                if let Some(mode) = str_at(message, "permissionMode") {
                    actions.push(Action::ModeReported(mode.to_owned()));
                }
            }
            _ => {}
        }
        actions
    }
}

fn str_at<'a>(value: &'a Value, key: &str) -> Option<&'a str> {
    value.get(key).and_then(Value::as_str)
}

/// Sub-agents' text belongs to their tool call, not to the conversation.
fn is_subagent(message: &Value) -> bool {
    message
        .get("parent_tool_use_id")
        .is_some_and(|p| !p.is_null())
}

fn control_request(message: &Value) -> Vec<Action> {
    let Some(request_id) = str_at(message, "request_id") else {
        return Vec::new();
    };
    let request = &message["request"];
    let subtype = str_at(request, "subtype").unwrap_or_default();
    if subtype != "can_use_tool" {
        return vec![Action::Unsupported {
            request_id: request_id.to_owned(),
            subtype: subtype.to_owned(),
        }];
    }
    let tool_name = str_at(request, "tool_name").unwrap_or("tool").to_owned();
    let input = request.get("input").cloned().unwrap_or_else(|| json!({}));
    let kind = match tool_name.as_str() {
        "ExitPlanMode" => PermissionKind::Plan,
        "AskUserQuestion" => PermissionKind::Question,
        _ => PermissionKind::Tool,
    };
    let title = tool_title(&tool_name, &input);
    let suggestions = request
        .get("permission_suggestions")
        .filter(|s| s.as_array().is_some_and(|a| !a.is_empty()))
        .cloned();
    vec![Action::Permission(ToolPermission {
        request_id: request_id.to_owned(),
        call_id: str_at(request, "tool_use_id").map(str::to_owned),
        tool_name,
        input,
        title,
        kind,
        suggestions,
    })]
}

fn control_response(message: &Value) -> Vec<Action> {
    let response = &message["response"];
    let Some(request_id) = str_at(response, "request_id") else {
        return Vec::new();
    };
    let result = if str_at(response, "subtype") == Some("error") {
        Err(str_at(response, "error")
            .unwrap_or("the request failed")
            .to_owned())
    } else {
        Ok(response.get("response").cloned().unwrap_or(Value::Null))
    };
    vec![Action::ControlResponse {
        request_id: request_id.to_owned(),
        result,
    }]
}

/// What a tool is, from its Claude Code name.
pub fn tool_kind(name: &str) -> ToolKind {
    match name {
        "Bash" | "BashOutput" | "KillShell" => ToolKind::Shell,
        "Read" | "NotebookRead" => ToolKind::Read,
        "Write" => ToolKind::Write,
        "Edit" | "MultiEdit" | "NotebookEdit" => ToolKind::Edit,
        "Grep" | "Glob" | "LS" => ToolKind::Search,
        "WebFetch" | "WebSearch" => ToolKind::Fetch,
        n if n.starts_with("mcp__") => ToolKind::Mcp,
        _ => ToolKind::Other,
    }
}

/// A short title: the tool and what it acts on.
fn tool_title(name: &str, input: &Value) -> String {
    let detail = [
        "description",
        "command",
        "file_path",
        "pattern",
        "url",
        "query",
    ]
    .iter()
    .find_map(|key| str_at(input, key));
    match detail {
        Some(d) => {
            let d: String = d.chars().take(120).collect();
            format!("{name}: {d}")
        }
        None => name.to_owned(),
    }
}

/// A running tool call from a `tool_use` block.
fn tool_call(id: &str, name: &str, input: Value) -> ToolCallUpdate {
    let kind = tool_kind(name);
    let mut call = ToolCallUpdate::new(id, name, kind, ToolStatus::Running, Value::Null);
    call.title = tool_title(name, &input);
    let path = str_at(&input, "file_path")
        .or_else(|| str_at(&input, "notebook_path"))
        .map(str::to_owned);
    if let Some(path) = &path {
        call.locations.push(Location {
            path: path.clone(),
            line: input.get("offset").and_then(Value::as_u64),
        });
        match name {
            "Write" => call.diff.push(FileDiff {
                path: path.clone(),
                change: ChangeKind::Add,
                move_path: None,
                unified: None,
                old_text: None,
                new_text: str_at(&input, "content").map(str::to_owned),
            }),
            "Edit" => call.diff.push(FileDiff {
                path: path.clone(),
                change: ChangeKind::Modify,
                move_path: None,
                unified: None,
                old_text: str_at(&input, "old_string").map(str::to_owned),
                new_text: str_at(&input, "new_string").map(str::to_owned),
            }),
            "MultiEdit" => {
                for edit in input
                    .get("edits")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    call.diff.push(FileDiff {
                        path: path.clone(),
                        change: ChangeKind::Modify,
                        move_path: None,
                        unified: None,
                        old_text: str_at(edit, "old_string").map(str::to_owned),
                        new_text: str_at(edit, "new_string").map(str::to_owned),
                    });
                }
            }
            _ => {}
        }
    }
    call.input = input;
    call
}

/// The text of a `tool_result`'s `content` (a string or a list of text blocks).
fn result_text(content: Option<&Value>) -> Option<String> {
    match content? {
        Value::String(s) => Some(s.clone()),
        Value::Array(blocks) => {
            let texts: Vec<&str> = blocks
                .iter()
                .filter(|b| str_at(b, "type") == Some("text"))
                .filter_map(|b| str_at(b, "text"))
                .collect();
            (!texts.is_empty()).then(|| texts.join("\n"))
        }
        _ => None,
    }
}

/// The diff of a file tool's rich result (`filePath`, `type` create/update and a
/// `structuredPatch` of hunks).
fn patch_diffs(rich: &Value) -> Option<Vec<FileDiff>> {
    let path = str_at(rich, "filePath")?.to_owned();
    let hunks = rich.get("structuredPatch")?.as_array()?;
    let change = match str_at(rich, "type") {
        Some("create") => ChangeKind::Add,
        _ => ChangeKind::Modify,
    };
    if hunks.is_empty() {
        // A new file has no hunks: its content is the diff.
        return (change == ChangeKind::Add).then(|| {
            vec![FileDiff {
                path,
                change,
                move_path: None,
                unified: None,
                old_text: None,
                new_text: str_at(rich, "content").map(str::to_owned),
            }]
        });
    }
    let mut unified = String::new();
    for hunk in hunks {
        let n = |key: &str| hunk.get(key).and_then(Value::as_u64).unwrap_or(0);
        unified.push_str(&format!(
            "@@ -{},{} +{},{} @@\n",
            n("oldStart"),
            n("oldLines"),
            n("newStart"),
            n("newLines")
        ));
        for line in hunk
            .get("lines")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            unified.push_str(line);
            unified.push('\n');
        }
    }
    Some(vec![FileDiff {
        path,
        change,
        move_path: None,
        unified: Some(unified),
        old_text: None,
        new_text: None,
    }])
}

/// Why a `result` says the turn failed.
fn result_error(message: &Value, subtype: &str) -> String {
    let detail = message
        .get("errors")
        .and_then(Value::as_array)
        .map(|errors| {
            errors
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join("; ")
        })
        .filter(|e| !e.is_empty())
        .or_else(|| str_at(message, "result").map(str::to_owned));
    let what = match subtype {
        "error_max_turns" => "the turn reached its limit of model calls".to_owned(),
        "error_max_budget_usd" => "the turn reached its budget".to_owned(),
        "error_during_execution" => "the turn failed while running".to_owned(),
        "success" => "the model call failed".to_owned(),
        other => format!("the turn failed ({other})"),
    };
    match detail {
        Some(detail) => format!("{what}: {detail}"),
        None => what,
    }
}
