//! What OpenCode's `GET /event` stream means for one session, as `ProviderEvent`s. Pure:
//! the adapter feeds every event in order and carries out what comes back (permission
//! requests need a reply channel, so they come back as `Mapped::Ask`).
//!
//! A turn has three phases. After a prompt is sent, events of the session are stale until
//! OpenCode records the prompt as a new user message (`message.updated`, role `user`):
//! an abort's trailing `session.idle` cannot end the next turn. From then on, parts of
//! the session's assistant messages are mapped, and `session.idle` ends the turn.

use std::collections::{HashMap, HashSet};

use serde_json::{Value, json};

use crate::domain::{
    Behavior, PermissionKind, PermissionOption, ToolKind, ToolStatus, TurnOutcome,
};
pub use crate::providers::Ask;
use crate::providers::{
    ChangeKind, FileDiff, Location, PermissionDecision, ProviderEvent, ToolCallUpdate, Usage,
};

/// What one OpenCode event asks of the adapter.
#[derive(Debug)]
pub enum Mapped {
    Event(ProviderEvent),
    /// `permission.asked` for the running turn: ask a person, then reply to OpenCode's
    /// request `request_id` (`per_…`).
    Ask {
        request_id: String,
        ask: Ask,
    },
    /// `permission.replied`: OpenCode has its answer; nobody needs to wait any more.
    Replied {
        request_id: String,
    },
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Phase {
    #[default]
    Idle,
    /// The prompt is sent; OpenCode has not recorded it yet.
    Sent,
    Running,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PartKind {
    Text,
    Reasoning,
}

#[derive(Debug)]
struct Part {
    kind: PartKind,
    /// The text reported so far as deltas.
    sent: String,
}

/// Maps the events of one OpenCode session.
#[derive(Debug)]
pub struct Mapper {
    session_id: String,
    phase: Phase,
    interrupted: bool,
    error: Option<String>,
    user_messages: HashSet<String>,
    parts: HashMap<String, Part>,
    /// The last status reported per tool call (`callID`).
    tools: HashMap<String, ToolStatus>,
    usage: Usage,
    steps: u32,
}

impl Mapper {
    pub fn new(session_id: impl Into<String>) -> Self {
        Self {
            session_id: session_id.into(),
            phase: Phase::Idle,
            interrupted: false,
            error: None,
            user_messages: HashSet::new(),
            parts: HashMap::new(),
            tools: HashMap::new(),
            usage: Usage::default(),
            steps: 0,
        }
    }

    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// A prompt is about to be sent: what follows its user message is the new turn.
    pub fn begin_turn(&mut self) {
        self.phase = Phase::Sent;
        self.interrupted = false;
        self.error = None;
        self.parts.clear();
        self.tools.clear();
        self.usage = Usage::default();
        self.steps = 0;
    }

    /// The prompt never reached OpenCode: there is no turn.
    pub fn abandon_turn(&mut self) {
        self.phase = Phase::Idle;
    }

    pub fn is_active(&self) -> bool {
        self.phase != Phase::Idle
    }

    /// An interrupt was asked for: the turn ends canceled.
    pub fn interrupt(&mut self) {
        if self.is_active() {
            self.interrupted = true;
        }
    }

    pub fn interrupted(&self) -> bool {
        self.interrupted
    }

    /// One event of `GET /event` (`{"type", "properties"}`).
    pub fn event(&mut self, event: &Value) -> Vec<Mapped> {
        let kind = event
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let props = event.get("properties").unwrap_or(&Value::Null);
        if session_of(props) != Some(self.session_id.as_str()) {
            return Vec::new();
        }
        match kind {
            "message.updated" => self.message_updated(props),
            "message.part.updated" => self.part_updated(props),
            "message.part.delta" => self.part_delta(props),
            "permission.asked" if self.is_active() && !self.interrupted => {
                vec![ask(props)]
            }
            "permission.replied" => match str_at(props, "requestID") {
                Some(id) => vec![Mapped::Replied {
                    request_id: id.to_owned(),
                }],
                None => Vec::new(),
            },
            "session.error" => self.session_error(props),
            "session.idle" if self.phase == Phase::Running => self.end_turn(),
            _ => Vec::new(),
        }
    }

    /// OpenCode recorded a user message: the prompt of the turn being sent starts it, and
    /// names the turn's `user_message` (OpenCode owns user-message ids).
    fn message_updated(&mut self, props: &Value) -> Vec<Mapped> {
        let info = props.get("info").unwrap_or(&Value::Null);
        if info.get("role").and_then(Value::as_str) != Some("user") {
            return Vec::new();
        }
        let Some(id) = str_at(info, "id") else {
            return Vec::new();
        };
        if self.user_messages.insert(id.to_owned()) && self.phase == Phase::Sent {
            self.phase = Phase::Running;
            return vec![Mapped::Event(ProviderEvent::UserMessageRecorded {
                message_id: id.to_owned(),
            })];
        }
        Vec::new()
    }

    fn of_user(&self, part: &Value) -> bool {
        str_at(part, "messageID").is_some_and(|m| self.user_messages.contains(m))
    }

    fn part_updated(&mut self, props: &Value) -> Vec<Mapped> {
        let part = props.get("part").unwrap_or(&Value::Null);
        if self.phase != Phase::Running || self.of_user(part) {
            return Vec::new();
        }
        let Some(id) = str_at(part, "id") else {
            return Vec::new();
        };
        match part.get("type").and_then(Value::as_str).unwrap_or_default() {
            "text" if part.get("synthetic").and_then(Value::as_bool) != Some(true) => {
                self.text(id, PartKind::Text, str_at(part, "text").unwrap_or_default())
            }
            "reasoning" => self.text(
                id,
                PartKind::Reasoning,
                str_at(part, "text").unwrap_or_default(),
            ),
            "tool" => self.tool(part),
            "step-finish" => self.step_finished(part),
            _ => Vec::new(),
        }
    }

    /// A text or reasoning part's whole text so far: what was not sent as deltas yet goes
    /// out as one, so the deltas always add up to the text.
    fn text(&mut self, id: &str, kind: PartKind, text: &str) -> Vec<Mapped> {
        let part = self.parts.entry(id.to_owned()).or_insert(Part {
            kind,
            sent: String::new(),
        });
        match text.strip_prefix(part.sent.as_str()) {
            Some(rest) if !rest.is_empty() => {
                let rest = rest.to_owned();
                part.sent.push_str(&rest);
                vec![Mapped::Event(chunk(id, kind, rest))]
            }
            _ => Vec::new(),
        }
    }

    fn part_delta(&mut self, props: &Value) -> Vec<Mapped> {
        if self.phase != Phase::Running
            || self.of_user(props)
            || str_at(props, "field") != Some("text")
        {
            return Vec::new();
        }
        let (Some(id), Some(delta)) = (str_at(props, "partID"), str_at(props, "delta")) else {
            return Vec::new();
        };
        if delta.is_empty() {
            return Vec::new();
        }
        let part = self.parts.entry(id.to_owned()).or_insert(Part {
            kind: PartKind::Text,
            sent: String::new(),
        });
        part.sent.push_str(delta);
        vec![Mapped::Event(chunk(id, part.kind, delta.to_owned()))]
    }

    fn tool(&mut self, part: &Value) -> Vec<Mapped> {
        let update = tool_update(part);
        if self.tools.get(&update.call_id) == Some(&update.status) {
            return Vec::new();
        }
        self.tools.insert(update.call_id.clone(), update.status);
        vec![Mapped::Event(ProviderEvent::ToolCall(update))]
    }

    fn step_finished(&mut self, part: &Value) -> Vec<Mapped> {
        let Some(tokens) = part.get("tokens") else {
            return Vec::new();
        };
        let n = |p: &str| tokens.pointer(p).and_then(Value::as_u64).unwrap_or(0);
        let (input, output, reasoning) = (n("/input"), n("/output"), n("/reasoning"));
        let (read, write) = (n("/cache/read"), n("/cache/write"));
        self.steps += 1;
        let u = &mut self.usage;
        u.input_tokens += input + read + write;
        u.output_tokens += output + reasoning;
        u.cached_input_tokens += read;
        u.cache_write_tokens += write;
        u.reasoning_tokens += reasoning;
        u.context_window_used = Some(input + read + write + output + reasoning);
        if let Some(cost) = part.get("cost").and_then(Value::as_f64) {
            *u.cost_usd.get_or_insert(0.0) += cost;
        }
        vec![Mapped::Event(ProviderEvent::Usage(self.usage.clone()))]
    }

    fn session_error(&mut self, props: &Value) -> Vec<Mapped> {
        if !self.is_active() {
            return Vec::new();
        }
        let error = props.get("error").unwrap_or(&Value::Null);
        let name = str_at(error, "name").unwrap_or("error");
        if name == "MessageAbortedError" {
            // An abort that was asked for here, or one from elsewhere: the turn is canceled.
            self.interrupted = true;
            return Vec::new();
        }
        let message = error
            .pointer("/data/message")
            .and_then(Value::as_str)
            .filter(|m| !m.is_empty())
            .map_or_else(|| name.to_owned(), |m| format!("{name}: {m}"));
        self.error = Some(message);
        if self.phase == Phase::Sent {
            // The prompt failed before OpenCode recorded it: no idle will follow for it.
            return self.end_turn();
        }
        Vec::new()
    }

    fn end_turn(&mut self) -> Vec<Mapped> {
        self.phase = Phase::Idle;
        let (outcome, error) = if self.interrupted {
            (TurnOutcome::Canceled, None)
        } else if let Some(e) = self.error.take() {
            (TurnOutcome::Failed, Some(e))
        } else {
            (TurnOutcome::Completed, None)
        };
        let usage = (self.steps > 0).then(|| self.usage.clone());
        vec![Mapped::Event(ProviderEvent::TurnEnded {
            outcome,
            error,
            usage,
        })]
    }
}

/// The session an event belongs to, wherever the event type keeps it.
fn session_of(props: &Value) -> Option<&str> {
    str_at(props, "sessionID")
        .or_else(|| props.get("info").and_then(|i| str_at(i, "sessionID")))
        .or_else(|| props.get("part").and_then(|p| str_at(p, "sessionID")))
}

fn str_at<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn chunk(id: &str, kind: PartKind, text: String) -> ProviderEvent {
    match kind {
        PartKind::Text => ProviderEvent::AssistantDelta {
            message_id: Some(id.to_owned()),
            text,
        },
        PartKind::Reasoning => ProviderEvent::ReasoningDelta {
            id: Some(id.to_owned()),
            text,
        },
    }
}

/// OpenCode's tool names as agentry's tool kinds (MCP tools are `<server>_<tool>`, which
/// cannot be told from built-in names: they are `other`).
pub fn tool_kind(name: &str) -> ToolKind {
    match name {
        "bash" => ToolKind::Shell,
        "read" => ToolKind::Read,
        "write" => ToolKind::Write,
        "edit" | "multiedit" | "patch" | "apply_patch" => ToolKind::Edit,
        "grep" | "glob" | "list" | "codesearch" => ToolKind::Search,
        "webfetch" | "websearch" => ToolKind::Fetch,
        _ => ToolKind::Other,
    }
}

/// A `tool` part as a tool call update.
fn tool_update(part: &Value) -> ToolCallUpdate {
    let name = str_at(part, "tool").unwrap_or("tool");
    let call_id = str_at(part, "callID")
        .or_else(|| str_at(part, "id"))
        .unwrap_or_default();
    let state = part.get("state").unwrap_or(&Value::Null);
    let interrupted = state
        .pointer("/metadata/interrupted")
        .and_then(Value::as_bool)
        == Some(true);
    let status = match str_at(state, "status").unwrap_or_default() {
        "running" => ToolStatus::Running,
        "completed" => ToolStatus::Completed,
        "error" if interrupted => ToolStatus::Canceled,
        "error" => ToolStatus::Failed,
        _ => ToolStatus::Pending,
    };
    let input = state
        .get("input")
        .filter(|i| i.is_object())
        .cloned()
        .unwrap_or_else(|| json!({}));
    let mut update = ToolCallUpdate::new(call_id, name, tool_kind(name), status, input.clone());
    if let Some(title) = str_at(state, "title").filter(|t| !t.is_empty()) {
        update.title = title.to_owned();
    }
    if status == ToolStatus::Completed {
        update.output = state.get("output").filter(|o| !o.is_null()).cloned();
    }
    update.error = str_at(state, "error").map(str::to_owned);
    if let Some(path) = str_at(&input, "filePath") {
        update.locations.push(Location {
            path: path.to_owned(),
            line: None,
        });
        match name {
            "write" => update.diff.push(FileDiff {
                path: path.to_owned(),
                change: match state.pointer("/metadata/exists").and_then(Value::as_bool) {
                    Some(true) => ChangeKind::Modify,
                    _ => ChangeKind::Add,
                },
                move_path: None,
                unified: None,
                old_text: None,
                new_text: str_at(&input, "content").map(str::to_owned),
            }),
            "edit" => update.diff.push(FileDiff {
                path: path.to_owned(),
                change: ChangeKind::Modify,
                move_path: None,
                unified: state
                    .pointer("/metadata/diff")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                old_text: str_at(&input, "oldString").map(str::to_owned),
                new_text: str_at(&input, "newString").map(str::to_owned),
            }),
            _ => {}
        }
    }
    update
}

/// agentry's options for every OpenCode permission; `reply_word` maps them back.
fn options() -> Vec<PermissionOption> {
    let option = |id: &str, label: &str, behavior| PermissionOption {
        id: id.to_owned(),
        label: label.to_owned(),
        behavior,
    };
    vec![
        option("allow", "Allow once", Behavior::Allow),
        option("allow_always", "Always allow", Behavior::Allow),
        option("deny", "Reject", Behavior::Deny),
    ]
}

fn ask(props: &Value) -> Mapped {
    let permission = str_at(props, "permission").unwrap_or("permission");
    let patterns: Vec<&str> = props
        .get("patterns")
        .and_then(Value::as_array)
        .map(|p| p.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let title = match permission {
        "edit" => format!("Edit {}", patterns.join(", ")),
        "bash" => format!("Run `{}`", patterns.join(" ")),
        other if patterns.is_empty() => format!("Allow {other}"),
        other => format!("Allow {other}: {}", patterns.join(", ")),
    };
    let mut input = json!({"permission": permission, "patterns": patterns});
    if let Some(metadata) = props.get("metadata").filter(|m| !m.is_null()) {
        input["metadata"] = metadata.clone();
    }
    let ask = Ask {
        kind: PermissionKind::Tool,
        title: title.trim_end().to_owned(),
        call_id: props
            .pointer("/tool/callID")
            .and_then(Value::as_str)
            .map(str::to_owned),
        input: Some(input),
        options: options(),
    };
    let request_id = str_at(props, "id").unwrap_or_default().to_owned();
    Mapped::Ask { request_id, ask }
}

/// OpenCode's reply (`once`, `always`, `reject`) for a person's decision.
pub fn reply_word(decision: &PermissionDecision) -> &'static str {
    match decision {
        PermissionDecision::Selected {
            option_id,
            behavior,
            ..
        } => match (option_id.as_str(), behavior) {
            ("allow_always" | "always", _) => "always",
            ("deny" | "reject", _) | (_, Behavior::Deny) => "reject",
            _ => "once",
        },
        PermissionDecision::Cancelled => "reject",
    }
}
