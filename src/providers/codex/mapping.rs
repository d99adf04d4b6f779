//! What Codex's app-server says, as agentry events: its notifications (items started and
//! completed, text and reasoning deltas, plans, token usage, turn ends) and its approval
//! requests. Pure: it keeps only the state the mapping needs (which messages streamed,
//! the turn's usage so far), so recorded transcripts can be replayed through it in tests.

use std::collections::HashSet;

use serde_json::{Value, json};

use crate::domain::{
    Behavior, PermissionKind, PermissionOption, ToolKind, ToolStatus, TurnOutcome,
};
use crate::process::jsonrpc::RequestId;
pub use crate::providers::Ask;
use crate::providers::{
    ChangeKind, FileDiff, Location, PlanEntry, PlanStatus, ProviderEvent, ToolCallUpdate, Usage,
};

/// One consequence of a message from Codex.
#[derive(Debug)]
pub enum Mapped {
    Event(ProviderEvent),
    /// Ask a person, then answer request `id` with `decision_reply(...)`.
    Ask {
        id: RequestId,
        ask: Ask,
    },
    /// Answer request `id` at once with an error: agentry does not serve it.
    Refuse {
        id: RequestId,
        message: String,
    },
    /// Codex no longer waits for the answer to request `id`.
    Resolved {
        id: RequestId,
    },
    /// A turn started; its id is what `turn/interrupt` needs.
    TurnStarted {
        turn_id: String,
    },
}

/// The mapping's memory between messages.
#[derive(Debug, Default)]
pub struct Mapper {
    /// Items whose text arrived as deltas (their completion repeats it).
    streamed: HashSet<String>,
    /// Thread token totals when the current turn's first model call began.
    turn_base: Option<Totals>,
    /// The current turn's usage so far.
    turn_usage: Option<Usage>,
    /// A turn is running (a resumed thread reports its old totals before any turn).
    in_turn: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Totals {
    input: u64,
    cached: u64,
    cache_write: u64,
    output: u64,
    reasoning: u64,
}

impl Totals {
    fn of(v: &Value) -> Self {
        let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        Self {
            input: n("inputTokens"),
            cached: n("cachedInputTokens"),
            cache_write: n("cacheWriteInputTokens"),
            output: n("outputTokens"),
            reasoning: n("reasoningOutputTokens"),
        }
    }

    fn minus(self, o: Self) -> Self {
        Self {
            input: self.input.saturating_sub(o.input),
            cached: self.cached.saturating_sub(o.cached),
            cache_write: self.cache_write.saturating_sub(o.cache_write),
            output: self.output.saturating_sub(o.output),
            reasoning: self.reasoning.saturating_sub(o.reasoning),
        }
    }
}

fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn event(e: ProviderEvent) -> Vec<Mapped> {
    vec![Mapped::Event(e)]
}

impl Mapper {
    /// A notification from Codex.
    pub fn notification(&mut self, method: &str, params: &Value) -> Vec<Mapped> {
        match method {
            "item/agentMessage/delta" => {
                let Some(text) = str_of(params, "delta").filter(|t| !t.is_empty()) else {
                    return Vec::new();
                };
                let id = str_of(params, "itemId").map(str::to_owned);
                if let Some(id) = &id {
                    self.streamed.insert(id.clone());
                }
                event(ProviderEvent::AssistantDelta {
                    message_id: id,
                    text: text.to_owned(),
                })
            }
            "item/reasoning/summaryTextDelta" | "item/reasoning/textDelta" => {
                let Some(text) = str_of(params, "delta").filter(|t| !t.is_empty()) else {
                    return Vec::new();
                };
                let id = str_of(params, "itemId").map(str::to_owned);
                if let Some(id) = &id {
                    self.streamed.insert(id.clone());
                }
                event(ProviderEvent::ReasoningDelta {
                    id,
                    text: text.to_owned(),
                })
            }
            "item/started" | "item/completed" => match params.get("item") {
                Some(item) => self.item(item, method == "item/completed"),
                None => Vec::new(),
            },
            "turn/started" => {
                self.in_turn = true;
                self.turn_base = None;
                self.turn_usage = None;
                self.streamed.clear();
                match params.pointer("/turn/id").and_then(Value::as_str) {
                    Some(id) => vec![Mapped::TurnStarted {
                        turn_id: id.to_owned(),
                    }],
                    None => Vec::new(),
                }
            }
            "turn/plan/updated" => {
                let entries = params
                    .get("plan")
                    .and_then(Value::as_array)
                    .map(|steps| {
                        steps
                            .iter()
                            .filter_map(|s| {
                                Some(PlanEntry {
                                    text: str_of(s, "step")?.to_owned(),
                                    status: PlanStatus::parse(str_of(s, "status").unwrap_or("")),
                                })
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                event(ProviderEvent::Plan { entries })
            }
            "thread/tokenUsage/updated" => match params.get("tokenUsage") {
                Some(usage) if self.in_turn => self.usage(usage),
                _ => Vec::new(),
            },
            "turn/completed" => {
                let turn = params.get("turn").unwrap_or(&Value::Null);
                let (outcome, error) = match str_of(turn, "status") {
                    Some("interrupted") => (TurnOutcome::Canceled, None),
                    Some("failed") => (
                        TurnOutcome::Failed,
                        Some(
                            turn.pointer("/error/message")
                                .and_then(Value::as_str)
                                .unwrap_or("the turn failed")
                                .to_owned(),
                        ),
                    ),
                    _ => (TurnOutcome::Completed, None),
                };
                self.streamed.clear();
                self.turn_base = None;
                self.in_turn = false;
                event(ProviderEvent::TurnEnded {
                    outcome,
                    error,
                    usage: self.turn_usage.take(),
                })
            }
            "error" => {
                let message = params
                    .pointer("/error/message")
                    .and_then(Value::as_str)
                    .unwrap_or("Codex reported an error");
                let retrying = params.get("willRetry").and_then(Value::as_bool) == Some(true);
                event(ProviderEvent::Error {
                    message: if retrying {
                        format!("{message} (retrying)")
                    } else {
                        message.to_owned()
                    },
                    code: Some("codex_error".to_owned()),
                })
            }
            "serverRequest/resolved" => match params.get("requestId").and_then(request_id) {
                Some(id) => vec![Mapped::Resolved { id }],
                None => Vec::new(),
            },
            _ => {
                tracing::trace!(method, "Codex notification ignored");
                Vec::new()
            }
        }
    }

    /// A request from Codex.
    pub fn request(&mut self, id: RequestId, method: &str, params: &Value) -> Vec<Mapped> {
        let ask = match method {
            "item/commandExecution/requestApproval" => command_approval(params),
            "item/fileChange/requestApproval" => file_change_approval(params),
            _ => {
                return vec![Mapped::Refuse {
                    id,
                    message: format!("agentry does not serve `{method}`"),
                }];
            }
        };
        vec![Mapped::Ask { id, ask }]
    }

    fn usage(&mut self, usage: &Value) -> Vec<Mapped> {
        let total = Totals::of(usage.get("total").unwrap_or(&Value::Null));
        let last_value = usage.get("last").unwrap_or(&Value::Null);
        let last = Totals::of(last_value);
        // The thread's totals before this turn: taken at the turn's first report.
        let base = *self.turn_base.get_or_insert_with(|| total.minus(last));
        let turn = total.minus(base);
        let used = last_value
            .get("totalTokens")
            .and_then(Value::as_u64)
            .unwrap_or(last.input + last.output);
        let usage = Usage {
            input_tokens: turn.input,
            output_tokens: turn.output,
            cached_input_tokens: turn.cached,
            cache_write_tokens: turn.cache_write,
            reasoning_tokens: turn.reasoning,
            context_window_max: usage.get("modelContextWindow").and_then(Value::as_u64),
            context_window_used: Some(used),
            cost_usd: None,
        };
        self.turn_usage = Some(usage.clone());
        event(ProviderEvent::Usage(usage))
    }

    fn item(&mut self, item: &Value, completed: bool) -> Vec<Mapped> {
        let id = str_of(item, "id").unwrap_or_default().to_owned();
        match str_of(item, "type").unwrap_or_default() {
            "agentMessage" if completed && !self.streamed.contains(&id) => {
                match str_of(item, "text").filter(|t| !t.is_empty()) {
                    Some(text) => event(ProviderEvent::AssistantMessage {
                        message_id: Some(id),
                        text: text.to_owned(),
                    }),
                    None => Vec::new(),
                }
            }
            "reasoning" if completed && !self.streamed.contains(&id) => {
                let parts = |key: &str| -> Vec<String> {
                    item.get(key)
                        .and_then(Value::as_array)
                        .map(|a| {
                            a.iter()
                                .filter_map(Value::as_str)
                                .map(str::to_owned)
                                .collect()
                        })
                        .unwrap_or_default()
                };
                let mut text = parts("summary");
                if text.is_empty() {
                    text = parts("content");
                }
                let text = text.join("\n\n");
                if text.is_empty() {
                    return Vec::new();
                }
                event(ProviderEvent::ReasoningDelta { id: Some(id), text })
            }
            "commandExecution" => event(ProviderEvent::ToolCall(command_call(item))),
            "fileChange" => event(ProviderEvent::ToolCall(file_change_call(item))),
            "mcpToolCall" => event(ProviderEvent::ToolCall(mcp_call(item))),
            "webSearch" => event(ProviderEvent::ToolCall(web_search_call(item, completed))),
            "dynamicToolCall" => event(ProviderEvent::ToolCall(dynamic_call(item))),
            other => {
                tracing::trace!(kind = other, "Codex item ignored");
                Vec::new()
            }
        }
    }
}

fn request_id(v: &Value) -> Option<RequestId> {
    match v {
        Value::Number(n) => n.as_i64().map(RequestId::Number),
        Value::String(s) => Some(RequestId::Text(s.clone())),
        _ => None,
    }
}

/// `inProgress`, `completed`, `failed`, `declined` as a tool status.
fn status(item: &Value) -> ToolStatus {
    match str_of(item, "status") {
        Some("completed") => ToolStatus::Completed,
        Some("failed" | "declined") => ToolStatus::Failed,
        _ => ToolStatus::Running,
    }
}

fn declined_error(item: &Value) -> Option<String> {
    (str_of(item, "status") == Some("declined")).then(|| "declined by the user".to_owned())
}

fn command_call(item: &Value) -> ToolCallUpdate {
    let command = str_of(item, "command").unwrap_or_default();
    let mut input = json!({"command": command});
    if let Some(cwd) = str_of(item, "cwd") {
        input["cwd"] = json!(cwd);
    }
    let status = status(item);
    let mut call = ToolCallUpdate::new(
        str_of(item, "id").unwrap_or_default(),
        "shell",
        ToolKind::Shell,
        status,
        input,
    );
    call.title = command.to_owned();
    if status.is_final() {
        let output = item.get("aggregatedOutput").and_then(Value::as_str);
        let exit_code = item.get("exitCode").and_then(Value::as_i64);
        if output.is_some() || exit_code.is_some() {
            call.output = Some(json!({"output": output.unwrap_or(""), "exit_code": exit_code}));
        }
        call.error = declined_error(item).or_else(|| {
            (status == ToolStatus::Failed).then(|| match exit_code {
                Some(code) => format!("the command exited with status {code}"),
                None => "the command failed".to_owned(),
            })
        });
    }
    call
}

/// A unified diff body (with hunks) as Codex gives it for an update.
fn looks_unified(diff: &str) -> bool {
    diff.starts_with("@@") || diff.starts_with("--- ") || diff.contains("\n@@")
}

fn file_change_call(item: &Value) -> ToolCallUpdate {
    let changes = item
        .get("changes")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut diffs = Vec::new();
    for change in &changes {
        let Some(path) = str_of(change, "path") else {
            continue;
        };
        let diff = str_of(change, "diff").unwrap_or_default();
        let kind = change.get("kind").unwrap_or(&Value::Null);
        let move_path = str_of(kind, "move_path").map(str::to_owned);
        let mut entry = FileDiff {
            path: path.to_owned(),
            change: ChangeKind::Modify,
            move_path: None,
            unified: None,
            old_text: None,
            new_text: None,
        };
        match str_of(kind, "type") {
            Some("add") => {
                entry.change = ChangeKind::Add;
                entry.new_text = Some(diff.to_owned());
            }
            Some("delete") => {
                entry.change = ChangeKind::Delete;
                entry.old_text = Some(diff.to_owned());
            }
            _ => {
                if move_path.is_some() {
                    entry.change = ChangeKind::Rename;
                    entry.move_path = move_path;
                }
                if looks_unified(diff) {
                    entry.unified = Some(diff.to_owned());
                } else if !diff.is_empty() {
                    entry.new_text = Some(diff.to_owned());
                }
            }
        }
        diffs.push(entry);
    }
    let all_new = !diffs.is_empty() && diffs.iter().all(|d| d.change == ChangeKind::Add);
    let (name, kind) = if all_new {
        ("write", ToolKind::Write)
    } else {
        ("edit", ToolKind::Edit)
    };
    let paths: Vec<&str> = diffs.iter().map(|d| d.path.as_str()).collect();
    let status = status(item);
    let mut call = ToolCallUpdate::new(
        str_of(item, "id").unwrap_or_default(),
        name,
        kind,
        status,
        json!({"changes": changes}),
    );
    call.title = format!(
        "{} {}",
        if all_new { "Write" } else { "Edit" },
        paths.join(", ")
    );
    call.locations = diffs
        .iter()
        .map(|d| Location {
            path: d.move_path.clone().unwrap_or_else(|| d.path.clone()),
            line: None,
        })
        .collect();
    call.diff = diffs;
    if status.is_final() {
        call.error = declined_error(item).or_else(|| {
            (status == ToolStatus::Failed).then(|| "the change could not be applied".to_owned())
        });
    }
    call
}

fn mcp_call(item: &Value) -> ToolCallUpdate {
    let server = str_of(item, "server").unwrap_or_default();
    let tool = str_of(item, "tool").unwrap_or_default();
    let status = status(item);
    let mut call = ToolCallUpdate::new(
        str_of(item, "id").unwrap_or_default(),
        format!("mcp__{server}__{tool}"),
        ToolKind::Mcp,
        status,
        item.get("arguments").cloned().unwrap_or(json!({})),
    );
    call.title = format!("{server}: {tool}");
    if status.is_final() {
        call.output = item.get("result").filter(|r| !r.is_null()).cloned();
        call.error = item
            .pointer("/error/message")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| (status == ToolStatus::Failed).then(|| "the tool failed".to_owned()));
    }
    call
}

fn web_search_call(item: &Value, completed: bool) -> ToolCallUpdate {
    let query = str_of(item, "query").unwrap_or_default();
    let mut input = json!({"query": query});
    if let Some(action) = item.get("action").filter(|a| !a.is_null()) {
        input["action"] = action.clone();
    }
    let status = if completed {
        ToolStatus::Completed
    } else {
        ToolStatus::Running
    };
    let mut call = ToolCallUpdate::new(
        str_of(item, "id").unwrap_or_default(),
        "web_search",
        ToolKind::Fetch,
        status,
        input,
    );
    call.title = format!("Search the web: {query}");
    if completed {
        call.output = item.get("results").filter(|r| !r.is_null()).cloned();
    }
    call
}

fn dynamic_call(item: &Value) -> ToolCallUpdate {
    let tool = str_of(item, "tool").unwrap_or("tool");
    let status = match (
        str_of(item, "status"),
        item.get("success").and_then(Value::as_bool),
    ) {
        (_, Some(false)) => ToolStatus::Failed,
        (Some("completed"), _) => ToolStatus::Completed,
        (Some("failed"), _) => ToolStatus::Failed,
        _ => ToolStatus::Running,
    };
    let mut call = ToolCallUpdate::new(
        str_of(item, "id").unwrap_or_default(),
        tool,
        ToolKind::Other,
        status,
        item.get("arguments").cloned().unwrap_or(json!({})),
    );
    if status.is_final() {
        call.output = item.get("contentItems").filter(|r| !r.is_null()).cloned();
    }
    call
}

fn option(id: &str, label: &str, behavior: Behavior) -> PermissionOption {
    PermissionOption {
        id: id.to_owned(),
        label: label.to_owned(),
        behavior,
    }
}

/// The options of an approval: once, for the session (when Codex offers it), decline.
fn options(available: Option<&Value>) -> Vec<PermissionOption> {
    let offers_session = match available.and_then(Value::as_array) {
        None => true,
        Some(list) => list.iter().any(|d| d.as_str() == Some("acceptForSession")),
    };
    let mut out = vec![option("accept", "Allow once", Behavior::Allow)];
    if offers_session {
        out.push(option(
            "acceptForSession",
            "Allow for this session",
            Behavior::Allow,
        ));
    }
    out.push(option("decline", "Deny", Behavior::Deny));
    out
}

fn command_approval(params: &Value) -> Ask {
    let command = str_of(params, "command").unwrap_or_default();
    let mut input = json!({"command": command});
    for key in ["cwd", "reason"] {
        if let Some(v) = params.get(key).filter(|v| !v.is_null()) {
            input[key] = v.clone();
        }
    }
    Ask {
        kind: PermissionKind::Tool,
        title: if command.is_empty() {
            "Run a command".to_owned()
        } else {
            format!("Run `{command}`")
        },
        call_id: str_of(params, "itemId").map(str::to_owned),
        input: Some(input),
        options: options(params.get("availableDecisions")),
    }
}

fn file_change_approval(params: &Value) -> Ask {
    let mut input = json!({});
    for key in ["reason", "grantRoot"] {
        if let Some(v) = params.get(key).filter(|v| !v.is_null()) {
            input[key] = v.clone();
        }
    }
    Ask {
        kind: PermissionKind::Tool,
        title: "Apply file changes".to_owned(),
        call_id: str_of(params, "itemId").map(str::to_owned),
        input: Some(input),
        options: options(None),
    }
}

/// The answer to an approval request: the chosen option's id is Codex's decision word;
/// no answer (the turn was canceled, the agent closed) is `cancel`.
pub fn decision_reply(option_id: Option<&str>) -> Value {
    let decision = match option_id {
        Some(id @ ("accept" | "acceptForSession" | "decline")) => id,
        Some(_) => "decline",
        None => "cancel",
    };
    json!({ "decision": decision })
}
