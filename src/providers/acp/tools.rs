//! Tool calls: what is known of each, so that partial updates yield complete events.

use super::*;

/// What is known of each tool call, so that partial updates yield complete events.
#[derive(Default)]
pub(super) struct ToolTracker {
    pub(super) calls: HashMap<String, ToolState>,
}

pub(super) struct ToolState {
    name: String,
    title: Option<String>,
    acp_kind: Option<String>,
    status: ToolStatus,
    input: Value,
    output: Option<Value>,
    error: Option<String>,
    diff: Vec<FileDiff>,
    locations: Vec<Location>,
}

impl ToolState {
    fn new() -> Self {
        Self {
            name: String::new(),
            title: None,
            acp_kind: None,
            status: ToolStatus::Pending,
            input: Value::Object(Map::new()),
            output: None,
            error: None,
            diff: Vec::new(),
            locations: Vec::new(),
        }
    }

    fn tool_kind(&self) -> ToolKind {
        match self.acp_kind.as_deref() {
            Some("execute") => ToolKind::Shell,
            Some("read") => ToolKind::Read,
            Some("edit")
                if !self.diff.is_empty()
                    && self.diff.iter().all(|d| d.change == ChangeKind::Add) =>
            {
                ToolKind::Write
            }
            Some("edit" | "delete" | "move") => ToolKind::Edit,
            Some("search") => ToolKind::Search,
            Some("fetch") => ToolKind::Fetch,
            _ => ToolKind::Other,
        }
    }

    fn to_update(&self, call_id: &str) -> ToolCallUpdate {
        ToolCallUpdate {
            call_id: call_id.to_owned(),
            name: self.name.clone(),
            title: self.title.clone().unwrap_or_else(|| self.name.clone()),
            tool_kind: self.tool_kind(),
            status: self.status,
            input: self.input.clone(),
            output: self.output.clone(),
            error: self.error.clone(),
            diff: self.diff.clone(),
            locations: self.locations.clone(),
            parent_call_id: None,
        }
    }
}

impl ToolTracker {
    /// A permission request's `rawInput` for a call announced earlier with its arguments
    /// is the agent's view for the person asked (Copilot: `{fileName, diff}` for a
    /// `create{path, file_text}`): the call keeps the arguments it was announced with.
    pub(super) fn keep_announced_input(&self, call: &mut Map<String, Value>) {
        let announced = call
            .get("toolCallId")
            .and_then(id_string)
            .and_then(|id| self.calls.get(&id))
            .is_some_and(|known| known.input.as_object().is_none_or(|o| !o.is_empty()));
        if announced {
            call.remove("rawInput");
        }
    }

    /// Merge one ACP tool call (`tool_call` when `replace`, else `tool_call_update` or the
    /// `toolCall` of a permission request) into the known state. Returns the complete
    /// update and whether anything a reader would notice changed.
    pub(super) fn apply(
        &mut self,
        call: &mut Map<String, Value>,
        replace: bool,
    ) -> Option<(ToolCallUpdate, bool)> {
        let call_id = call.get("toolCallId").and_then(id_string)?;
        let (mut state, mut changed) = match self.calls.remove(&call_id) {
            Some(previous) if !replace => (previous, false),
            _ => (ToolState::new(), true),
        };
        let is_new = changed;

        if let Some(title) = take_string(call.get_mut("title")) {
            changed |= state.title.as_deref() != Some(title.as_str());
            state.title = Some(title);
        }
        if let Some(kind) = call.get("kind").and_then(Value::as_str) {
            changed |= state.acp_kind.as_deref() != Some(kind);
            state.acp_kind = Some(kind.to_owned());
        }
        if let Some(status) = call
            .get("status")
            .and_then(Value::as_str)
            .and_then(tool_status)
        {
            changed |= state.status != status;
            state.status = status;
        }
        if let Some(input) = call.get_mut("rawInput").map(Value::take)
            && !input.is_null()
        {
            changed |= state.input != input;
            state.input = input;
        }
        let content = call.get("content").and_then(Value::as_array);
        if let Some(items) = content {
            let diffs: Vec<FileDiff> = items
                .iter()
                .filter(|item| item.get("type").and_then(Value::as_str) == Some("diff"))
                .filter_map(acp_diff)
                .collect();
            if !diffs.is_empty() {
                changed |= state.diff != diffs;
                state.diff = diffs;
            }
        }
        if let Some(locations) = call.get("locations").and_then(Value::as_array) {
            let locations: Vec<Location> = locations
                .iter()
                .filter_map(|l| {
                    Some(Location {
                        path: l.get("path")?.as_str()?.to_owned(),
                        line: l.get("line").and_then(Value::as_u64),
                    })
                })
                .collect();
            changed |= state.locations != locations;
            state.locations = locations;
        }
        let text = content.and_then(|items| content_text(items));
        match call.get_mut("rawOutput").map(Value::take) {
            Some(output) if !output.is_null() => state.output = Some(output),
            _ => {
                if let Some(text) = &text {
                    state.output = Some(Value::String(text.clone()));
                }
            }
        }
        state.error = if state.status == ToolStatus::Failed {
            text.or_else(|| {
                state.output.as_ref().and_then(|out| match out {
                    Value::String(s) => Some(s.clone()),
                    Value::Object(o) => o
                        .get("error")
                        .or_else(|| o.get("message"))
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                    _ => None,
                })
            })
        } else {
            None
        };
        if let Some(name) = take_string(call.get_mut("name")) {
            state.name = name;
        } else if is_new || state.name.is_empty() {
            // Named once, from what is known first, so that the name stays stable.
            state.name = tool_kind_name(state.tool_kind()).to_owned();
        }

        let update = state.to_update(&call_id);
        self.calls.insert(call_id, state);
        Some((update, changed))
    }
}
