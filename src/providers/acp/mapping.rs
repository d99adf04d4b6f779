//! ACP's wire values read as agentry's: the modes and models a session answer announces,
//! tool-call content, update tags, permission options and outcomes, and the end of a turn.
//! Pure (no I/O).

use super::*;

/// The select config option of `category` (`mode`, `model`) in a session answer, as
/// (value, name, description) of each choice (groups flattened), and its current value.
pub(super) fn option_choices(
    answer: &Value,
    category: &str,
) -> Option<(Vec<Value>, Option<String>)> {
    let option = answer.get("configOptions")?.as_array()?.iter().find(|o| {
        match o.get("category").and_then(Value::as_str) {
            Some(c) => c == category,
            None => o.get("id").and_then(Value::as_str) == Some(category),
        }
    })?;
    let mut choices = Vec::new();
    for choice in option.get("options")?.as_array()? {
        match choice.get("options").and_then(Value::as_array) {
            Some(group) => choices.extend(group.iter().cloned()),
            None => choices.push(choice.clone()),
        }
    }
    let current = option
        .get("currentValue")
        .and_then(Value::as_str)
        .map(str::to_owned);
    Some((choices, current))
}

/// An announced choice as `(id, label, description)`, its id under `id_key`; the label is
/// its `name`, else its id.
pub(super) fn announced_choice<'a>(
    entry: &'a Value,
    id_key: &str,
) -> Option<(&'a str, &'a str, Option<&'a str>)> {
    let id = entry.get(id_key)?.as_str()?;
    let label = entry.get("name").and_then(Value::as_str).unwrap_or(id);
    Some((id, label, entry.get("description").and_then(Value::as_str)))
}

/// `modes.availableModes` of a session answer (`[{id, name, description}]`), else the
/// choices of its mode config option, as agentry modes. None is taken as unattended:
/// the agent does not say, and the settings can.
pub(super) fn announced_modes(answer: &Value) -> Option<Vec<ModeInfo>> {
    let listed = answer
        .get("modes")
        .and_then(|m| m.get("availableModes"))
        .and_then(Value::as_array);
    let (entries, id_key) = match listed {
        Some(list) => (list.clone(), "id"),
        None => (option_choices(answer, "mode")?.0, "value"),
    };
    Some(
        entries
            .iter()
            .filter_map(|e| announced_choice(e, id_key))
            .map(|(id, label, description)| ModeInfo {
                id: id.to_owned(),
                label: label.to_owned(),
                description: description.map(str::to_owned),
                unattended: false,
            })
            .collect(),
    )
}

/// `models.availableModels` of a session answer (`[{modelId, name, description}]`), the
/// one named by `models.currentModelId` the default; else the choices of its model
/// config option, the current one the default.
pub(super) fn announced_models(answer: &Value) -> Option<Vec<ModelInfo>> {
    let (entries, current, id_key) = match answer.get("models") {
        Some(models) => (
            models.get("availableModels")?.as_array()?.clone(),
            models
                .get("currentModelId")
                .and_then(Value::as_str)
                .map(str::to_owned),
            "modelId",
        ),
        None => {
            let (choices, current) = option_choices(answer, "model")?;
            (choices, current, "value")
        }
    };
    Some(
        entries
            .iter()
            .filter_map(|e| announced_choice(e, id_key))
            .map(|(id, label, _)| ModelInfo {
                id: id.to_owned(),
                label: label.to_owned(),
                is_default: current.as_deref() == Some(id),
                context_window: None,
            })
            .collect(),
    )
}

/// An ACP `diff` content item (`path`, `oldText` absent or null for a new file, `newText`).
/// Gemini sends `oldText: ""` for a new file and says so in `_meta.kind` (`add`).
pub(super) fn acp_diff(item: &Value) -> Option<FileDiff> {
    let path = item.get("path")?.as_str()?.to_owned();
    let old_text = item
        .get("oldText")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let new_text = item
        .get("newText")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let added =
        old_text.is_none() || item.pointer("/_meta/kind").and_then(Value::as_str) == Some("add");
    Some(FileDiff {
        path,
        change: if added {
            ChangeKind::Add
        } else {
            ChangeKind::Modify
        },
        move_path: None,
        unified: None,
        old_text: if added { None } else { old_text },
        new_text,
    })
}

pub(super) fn tool_kind_name(kind: ToolKind) -> &'static str {
    match kind {
        ToolKind::Shell => "shell",
        ToolKind::Read => "read",
        ToolKind::Edit => "edit",
        ToolKind::Write => "write",
        ToolKind::Search => "search",
        ToolKind::Fetch => "fetch",
        ToolKind::Mcp => "mcp",
        ToolKind::Other => "other",
    }
}

pub(super) fn tool_status(status: &str) -> Option<ToolStatus> {
    Some(match status {
        "pending" => ToolStatus::Pending,
        "in_progress" => ToolStatus::Running,
        "completed" => ToolStatus::Completed,
        "failed" => ToolStatus::Failed,
        "cancelled" | "canceled" => ToolStatus::Canceled,
        _ => return None,
    })
}

/// An id that may arrive as a string or a number.
pub(super) fn id_string(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

pub(super) fn take_string(value: Option<&mut Value>) -> Option<String> {
    match value.map(Value::take) {
        Some(Value::String(s)) => Some(s),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    }
}

/// The text of `{"type":"content","content":{"type":"text","text":…}}` items.
pub(super) fn content_text(items: &[Value]) -> Option<String> {
    let mut text = String::new();
    for item in items {
        if item.get("type").and_then(Value::as_str) != Some("content") {
            continue;
        }
        let Some(block) = item.get("content") else {
            continue;
        };
        if block.get("type").and_then(Value::as_str) == Some("text")
            && let Some(t) = block.get("text").and_then(Value::as_str)
        {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(t);
        }
    }
    (!text.is_empty()).then_some(text)
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum UpdateTag {
    MessageChunk,
    ThoughtChunk,
    UserChunk,
    ToolCall,
    ToolCallUpdate,
    Plan,
    ModeUpdate,
    ConfigUpdate,
    Usage,
    Other,
}

impl UpdateTag {
    pub(super) fn of(tag: &str) -> Self {
        match tag {
            "agent_message_chunk" => Self::MessageChunk,
            "agent_thought_chunk" => Self::ThoughtChunk,
            "user_message_chunk" => Self::UserChunk,
            "tool_call" => Self::ToolCall,
            "tool_call_update" => Self::ToolCallUpdate,
            "plan" => Self::Plan,
            "current_mode_update" => Self::ModeUpdate,
            "config_option_update" => Self::ConfigUpdate,
            "usage_update" => Self::Usage,
            _ => Self::Other,
        }
    }
}

/// The text of a chunk's `content`, when it is a non-empty text block.
pub(super) fn take_text_chunk(update: &mut Map<String, Value>) -> Option<String> {
    let content = update.get_mut("content")?;
    if content.get("type").and_then(Value::as_str) != Some("text") {
        return None;
    }
    match content.get_mut("text").map(Value::take) {
        Some(Value::String(text)) if !text.is_empty() => Some(text),
        _ => None,
    }
}

/// The options of a permission request as agentry shows them, each with the agent's own
/// option id. Agents name their options differently (`proceed_once`, `allow_once`,
/// `approved`, `once`…); what they mean is in the option's `kind`, so agentry's ids come
/// from it: `allow`, `allow_always`, `deny`, `deny_always` (a second option of the same
/// meaning gets `_2`, …). An option without a known kind is judged by its words.
pub(super) fn permission_options(options: &[Value]) -> Vec<(PermissionOption, String)> {
    let mut out: Vec<(PermissionOption, String)> = Vec::new();
    for option in options {
        let Some(provider_id) = option.get("optionId").and_then(id_string) else {
            continue;
        };
        let label = option
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or(&provider_id)
            .to_owned();
        let kind = option
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let (base, behavior) = match kind {
            "allow_once" => ("allow", Behavior::Allow),
            "allow_always" => ("allow_always", Behavior::Allow),
            "reject_once" => ("deny", Behavior::Deny),
            "reject_always" => ("deny_always", Behavior::Deny),
            _ => {
                // Unknown kinds: judge by the words agents use for refusing.
                let words = format!("{provider_id} {label}").to_ascii_lowercase();
                if ["reject", "deny", "cancel", "abort", "no"]
                    .iter()
                    .any(|w| words.split(|c: char| !c.is_alphanumeric()).any(|t| t == *w))
                {
                    ("deny", Behavior::Deny)
                } else {
                    ("allow", Behavior::Allow)
                }
            }
        };
        let mut id = base.to_owned();
        let mut n = 1;
        while out.iter().any(|(o, _)| o.id == id) {
            n += 1;
            id = format!("{base}_{n}");
        }
        out.push((
            PermissionOption {
                id,
                label,
                behavior,
            },
            provider_id,
        ));
    }
    out
}

/// The agent's option id for a person's choice: the option with agentry's id `chosen`
/// (or, for a client that sent the agent's own id, that one), else the first option of
/// the chosen behavior.
pub(super) fn provider_option(
    offered: &[(PermissionOption, String)],
    chosen: &str,
    behavior: Behavior,
) -> Option<String> {
    offered
        .iter()
        .find(|(option, _)| option.id == chosen)
        .or_else(|| offered.iter().find(|(_, provider)| provider == chosen))
        .or_else(|| {
            offered
                .iter()
                .find(|(option, _)| option.behavior == behavior)
        })
        .map(|(_, provider)| provider.clone())
}

pub(super) fn permission_outcome(option_id: Option<String>) -> Value {
    let outcome = match option_id {
        Some(id) => {
            proto::RequestPermissionOutcome::Selected(proto::SelectedPermissionOutcome::new(id))
        }
        None => proto::RequestPermissionOutcome::Cancelled,
    };
    serde_json::to_value(proto::RequestPermissionResponse::new(outcome))
        .unwrap_or_else(|_| json!({"outcome": {"outcome": "cancelled"}}))
}

/// The usage an agent put in its `session/prompt` answer: `usage` (Copilot, OpenCode) or
/// `_meta.quota.token_count` (Gemini, the turn's sum over its model calls).
pub(super) fn prompt_usage(response: &Value) -> Option<Usage> {
    if let Some(count) = response
        .pointer("/_meta/quota/token_count")
        .and_then(Value::as_object)
        && response.get("usage").is_none()
    {
        let number = |key: &str| count.get(key).and_then(Value::as_u64).unwrap_or(0);
        return Some(Usage {
            input_tokens: number("input_tokens"),
            output_tokens: number("output_tokens"),
            ..Usage::default()
        });
    }
    let usage = response.get("usage")?.as_object()?;
    let number = |key: &str| usage.get(key).and_then(Value::as_u64).unwrap_or(0);
    Some(Usage {
        input_tokens: number("inputTokens"),
        output_tokens: number("outputTokens"),
        cached_input_tokens: number("cachedReadTokens"),
        ..Usage::default()
    })
}

/// How a `session/prompt` answer ends the turn; `None` when the connection is gone (the
/// supervisor reports that as `Exited`).
pub(super) fn turn_end(
    result: Result<Value, acp::Error>,
    interrupted: bool,
) -> Option<ProviderEvent> {
    let (outcome, error, usage) = match result {
        Ok(response) => {
            let usage = prompt_usage(&response);
            match response.get("stopReason").and_then(Value::as_str) {
                Some("cancelled") => (TurnOutcome::Canceled, None, usage),
                Some("refusal") => (
                    TurnOutcome::Failed,
                    Some("the agent refused".to_owned()),
                    usage,
                ),
                Some("max_tokens") => (
                    TurnOutcome::Completed,
                    Some("the agent stopped at its token limit".to_owned()),
                    usage,
                ),
                Some("max_turn_requests") => (
                    TurnOutcome::Completed,
                    Some("the agent stopped at its limit of requests per turn".to_owned()),
                    usage,
                ),
                _ => (TurnOutcome::Completed, None, usage),
            }
        }
        Err(e) if acp::is_incoming_transport_closed(&e) || acp::is_connection_terminated(&e) => {
            return None;
        }
        Err(e) if interrupted || e.code == acp::ErrorCode::REQUEST_CANCELLED => {
            (TurnOutcome::Canceled, None, None)
        }
        Err(e) => (TurnOutcome::Failed, Some(e.message), None),
    };
    Some(ProviderEvent::TurnEnded {
        outcome,
        error,
        usage,
    })
}
