//! The generic ACP adapter: runs any agent that speaks the Agent Client Protocol on stdio
//! (Gemini, Copilot, OpenCode, codex-acp, the built-in mock) as a child process, drives
//! one session over the `agent-client-protocol` crate and turns its session updates, tool
//! calls and permission requests into `ProviderEvent`s.
//!
//! Ordering: every inbound message is handled in the connection's dispatch loop, one at a
//! time, and each handler hands its events to the sink before the next message is looked
//! at. The `session/prompt` response is consumed by an ordered callback, so `TurnEnded`
//! follows every update the agent sent before answering. `Exited` is sent once, last,
//! after the connection has ended and the process has been reaped.
//!
//! `session/update` notifications do not go through the SDK: the agent's stdout passes
//! through a gate (`gate`) that takes them out of the stream into a lane that
//! `handle_updates` reads, in order. Every other line reaches the SDK only after the
//! updates written before it are handled, so the order above holds. The gate and the lane
//! run in a task of their own (`pump`), which hands the SDK its lines through an in-memory
//! pipe: an update wakes that task alone, never the SDK's connection.
//!
//! Back-pressure: a handler waits for room in the sink, and the gate stops reading once
//! `UPDATES_IN_FLIGHT` updates are read and not yet handled, so an agent that outruns its
//! consumer blocks on its pipe instead of growing the server's memory. The actor reads
//! events while it waits for an answer.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_client_protocol::v1::schema as proto;
use agent_client_protocol::{self as acp, Dispatch, HandleDispatchFrom, Handled, UntypedMessage};
use async_trait::async_trait;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::{oneshot, watch};
use tokio_util::compat::{TokioAsyncReadCompatExt, TokioAsyncWriteCompatExt};

use super::emitter::{Emitter, StopSignals, Stopper, report_exit};
use super::{
    Availability, ChangeKind, CliConfig, EventSink, FileDiff, Location, ModeInfo, ModelInfo,
    PermissionDecision, PermissionRequest, PlanEntry, PlanStatus, ProcessLauncher, Provider,
    ProviderCapabilities, ProviderError, ProviderEvent, ProviderInfo, ProviderSession, SessionInfo,
    SessionSpec, ToolCallUpdate, TurnInput, Usage,
};
use crate::domain::{
    Behavior, PermissionKind, PermissionOption, ToolKind, ToolStatus, TurnOutcome,
};
use crate::process::output::{StderrReader, StderrTail, describe_exit};
use crate::process::{CommandSpec, ManagedChild, find_executable};

mod gate;
mod presets;

use gate::{UpdateCredits, UpdateGate};
pub use presets::ModePreset;

/// How long the agent may take to initialize and open its session.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// After the process exits, how long its remaining output may take to be read (a member
/// of its group still holding the pipe, as codex-acp's do, must not delay the failure of
/// the turn; what the leader wrote before it died is in the pipe already).
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);
/// The in-memory pipe between the gate and the SDK (lines other than updates).
const SDK_PIPE_BYTES: usize = 64 * 1024;
/// After the connection ends, how long the process may take to exit on its own.
const EXIT_AFTER_EOF: Duration = Duration::from_millis(500);
/// After `session/load` answers, how long the agent must send no update for its history
/// replay to count as over, and the longest that wait may take.
const REPLAY_QUIET: Duration = Duration::from_millis(200);
const REPLAY_SETTLE_MAX: Duration = Duration::from_secs(5);
/// `session/update` notifications read from the agent and not yet handed to the event
/// sink; at this many, its stdout is not read until the sink takes some (see `gate`).
const UPDATES_IN_FLIGHT: usize = 1024;

/// Configuration of one ACP provider (built in or from the providers config).
#[derive(Debug, Clone)]
pub struct AcpProviderConfig {
    pub id: String,
    pub label: String,
    /// argv of the agent; the first element is looked up on PATH.
    pub command: Vec<String>,
    /// Extra environment for the child.
    pub env: BTreeMap<String, String>,
    /// Variables passed on from the server's own environment when set there.
    pub pass_env: Vec<String>,
    pub modes: Vec<ModeInfo>,
    pub default_mode: Option<String>,
    /// Models known without starting the agent (served by `GET /v1/providers/{id}/models`).
    pub models: Vec<ModelInfo>,
    /// The flag that starts the agent on a model (`--model`), for agents that report no
    /// model config option: a session's model is then passed as `<flag> <model>`.
    pub model_flag: Option<String>,
    /// Offer the agent `fs/read_text_file` (writes are always offered, inside the
    /// workspace). Off for an agent that cannot tell a missing file from a failed read in
    /// a client's answer (Gemini): it then reads files itself.
    pub serve_reads: bool,
    /// The `authenticate` method to try, once, when the agent answers that authentication
    /// is required to open or reopen a session (Gemini wants one to reopen a session when
    /// its credential is a plain API key).
    pub auth_method: Option<String>,
}

impl AcpProviderConfig {
    /// The configuration of a built-in CLI that speaks ACP: its command, the flags that
    /// put it in ACP mode (`protocol_args`), then the `args` setting.
    pub fn from_cli(cfg: CliConfig, protocol_args: &[&str]) -> Self {
        let mut command = cfg.command;
        command.extend(protocol_args.iter().map(|a| (*a).to_owned()));
        command.extend(cfg.args);
        Self {
            id: cfg.id,
            label: cfg.label,
            command,
            env: cfg.env,
            pass_env: cfg.pass_env,
            modes: cfg.modes,
            default_mode: cfg.default_mode,
            models: Vec::new(),
            model_flag: None,
            serve_reads: true,
            auth_method: None,
        }
    }
}

/// A provider that runs an ACP agent over stdio.
pub struct AcpProvider {
    cfg: AcpProviderConfig,
    presets: Arc<[ModePreset]>,
    /// What its agent announced when it last opened a session.
    announced: Arc<Mutex<Announced>>,
    /// Whether its agent is said to take MCP servers (`capabilities.mcp_servers`).
    takes_mcp: bool,
}

/// The modes and models an agent announces in its `session/new` (or `session/load`)
/// answer: what an agent whose settings name none offers.
#[derive(Debug, Clone, Default)]
struct Announced {
    modes: Vec<ModeInfo>,
    models: Vec<ModelInfo>,
}

impl Announced {
    /// Take in what an answer announces; what it leaves out is kept from before.
    fn absorb(&mut self, answer: &Value) {
        if let Some(modes) = announced_modes(answer) {
            self.modes = modes;
        }
        if let Some(models) = announced_models(answer) {
            self.models = models;
        }
    }
}

/// The select config option of `category` (`mode`, `model`) in a session answer, as
/// (value, name, description) of each choice (groups flattened), and its current value.
fn option_choices(answer: &Value, category: &str) -> Option<(Vec<Value>, Option<String>)> {
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
fn announced_choice<'a>(
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
fn announced_modes(answer: &Value) -> Option<Vec<ModeInfo>> {
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
fn announced_models(answer: &Value) -> Option<Vec<ModelInfo>> {
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

impl AcpProvider {
    pub fn new(cfg: AcpProviderConfig) -> Self {
        Self {
            cfg,
            presets: Arc::from(Vec::new()),
            announced: Arc::default(),
            takes_mcp: true,
        }
    }

    /// For an agent that has no MCP client (the mock): it is said not to take MCP
    /// servers, so none of agentry's own is made for it.
    pub fn without_mcp(mut self) -> Self {
        self.takes_mcp = false;
        self
    }

    /// Modes that are combinations of the agent's config options (see `presets`). A mode
    /// without a preset is set as before: `session/set_mode` or the mode option.
    pub fn with_mode_presets(mut self, presets: Vec<ModePreset>) -> Self {
        self.presets = presets.into();
        self
    }

    pub fn config(&self) -> &AcpProviderConfig {
        &self.cfg
    }
}

#[async_trait]
impl Provider for AcpProvider {
    /// The configured models; else those the agent announces, asked of it by opening a
    /// session in the probe's directory when none was opened since the server started.
    async fn models(&self, probe: &super::Probe) -> Result<Vec<ModelInfo>, ProviderError> {
        if !self.cfg.models.is_empty() {
            return Ok(self.cfg.models.clone());
        }
        let known = lock(&self.announced).models.clone();
        if !known.is_empty() {
            return Ok(known);
        }
        let (events, mut drain) = tokio::sync::mpsc::channel(64);
        // Nobody reads the probe session's events: they are drained and dropped.
        let drained = tokio::spawn(async move { while drain.recv().await.is_some() {} });
        let spec = SessionSpec {
            cwd: probe.cwd.clone(),
            model: None,
            mode: None,
            system_prompt: None,
            mcp_servers: BTreeMap::new(),
            resume: None,
        };
        let started = start_session(
            &self.cfg,
            self.presets.clone(),
            self.announced.clone(),
            spec,
            probe.launcher.clone(),
            events,
        )
        .await;
        let result = match started {
            Ok((session, _)) => {
                session.close().await;
                Ok(lock(&self.announced).models.clone())
            }
            Err(e) => Err(e),
        };
        drained.abort();
        result
    }

    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: self.cfg.id.clone(),
            label: self.cfg.label.clone(),
            protocol: "acp".to_owned(),
            capabilities: ProviderCapabilities {
                resume: true,
                set_mode: true,
                set_model: true,
                permissions: true,
                mcp_servers: self.takes_mcp,
            },
            // The settings' modes; else those the agent announced.
            modes: if self.cfg.modes.is_empty() {
                lock(&self.announced).modes.clone()
            } else {
                self.cfg.modes.clone()
            },
            default_mode: self.cfg.default_mode.clone(),
        }
    }

    async fn availability(&self) -> Availability {
        match self.cfg.command.first() {
            None => Availability::Unavailable("no command is configured".to_owned()),
            Some(program) if find_executable(program).is_some() => Availability::Available,
            Some(program) => {
                Availability::Unavailable(format!("`{program}` was not found on PATH"))
            }
        }
    }

    async fn start(
        &self,
        spec: SessionSpec,
        launcher: Arc<dyn ProcessLauncher>,
        events: EventSink,
    ) -> Result<(Box<dyn ProviderSession>, SessionInfo), ProviderError> {
        start_session(
            &self.cfg,
            self.presets.clone(),
            self.announced.clone(),
            spec,
            launcher,
            events,
        )
        .await
    }
}

// ---------------------------------------------------------------------------------------
// Events out
// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// Per-session state shared by the handlers, the session handle and the supervisor
// ---------------------------------------------------------------------------------------

struct Shared {
    events: Emitter,
    /// The session's workspace, canonical; file requests must stay inside it.
    root: PathBuf,
    /// `session/load` is replaying history: drop every update until it answers and the
    /// agent has gone quiet (see `load_session`).
    replaying: AtomicBool,
    /// `session/update` notifications received so far, replayed ones included.
    updates_seen: AtomicU64,
    /// The session is being set up: mode and model changes go into `SessionInfo` rather
    /// than out as events.
    starting: AtomicBool,
    tools: Mutex<ToolTracker>,
    config: Mutex<ConfigState>,
    /// Bumped by `interrupt`: every permission request waiting at that moment is answered
    /// with `cancelled`.
    permission_epoch: watch::Sender<u64>,
    turn_active: AtomicBool,
    interrupted: AtomicBool,
    /// The session is being closed on purpose.
    closing: AtomicBool,
    stderr: StderrTail,
    /// Credits of the gate on the agent's stdout: one per update being handled.
    update_credits: Arc<UpdateCredits>,
}

impl Shared {
    fn stderr_tail(&self) -> String {
        self.stderr.tail()
    }

    /// Report a mode or model change, unless the session is still being set up.
    async fn report_change(&self, event: ProviderEvent) {
        if !self.starting.load(Ordering::Acquire) {
            self.events.emit(event).await;
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Modes and the model as the agent reported them.
#[derive(Default)]
struct ConfigState {
    current_mode: Option<String>,
    /// The agent reported `modes` (so `session/set_mode` applies).
    has_modes: bool,
    /// A config option that selects the mode (for agents without `modes`).
    mode_option: Option<String>,
    /// The config option that selects the model.
    model_option: Option<String>,
    current_model: Option<String>,
    /// Bumped whenever the agent itself reports a change.
    mode_reports: u64,
    model_reports: u64,
    /// Modes read from and set through the config options; when there are any, the
    /// current mode is the preset the options amount to.
    presets: Arc<[ModePreset]>,
    /// The agent's config options as last reported (kept for the presets only).
    options: Vec<proto::SessionConfigOption>,
}

/// What absorbing an agent's config options changed.
#[derive(Default)]
struct ConfigChanges {
    mode: Option<String>,
    model: Option<String>,
}

impl ConfigState {
    fn absorb_modes(&mut self, modes: Option<&proto::SessionModeState>) {
        if let Some(modes) = modes {
            self.has_modes = true;
            if self.presets.is_empty() {
                self.current_mode = Some(modes.current_mode_id.to_string());
            } else {
                presets::set_mode_value(&mut self.options, &modes.current_mode_id.0);
            }
        }
    }

    /// The agent reported its mode (`current_mode_update`): the agentry mode it now is
    /// in, when that changed.
    fn mode_reported(&mut self, mode: &str) -> Option<String> {
        let mode = if self.presets.is_empty() {
            mode.to_owned()
        } else {
            presets::set_mode_value(&mut self.options, mode);
            presets::current_preset(&self.presets, &self.options)?
                .id
                .clone()
        };
        if self.current_mode.as_deref() == Some(mode.as_str()) {
            return None;
        }
        self.current_mode = Some(mode.clone());
        self.mode_reports += 1;
        Some(mode)
    }

    /// Take in the agent's config options; report the mode/model values that changed.
    fn absorb_options(&mut self, options: &[proto::SessionConfigOption]) -> ConfigChanges {
        let mut changes = ConfigChanges::default();
        if !self.presets.is_empty() {
            presets::merge_options(&mut self.options, options);
            let preset = presets::current_preset(&self.presets, &self.options);
            if let Some(preset) = preset
                && self.current_mode.as_deref() != Some(preset.id.as_str())
            {
                self.current_mode = Some(preset.id.clone());
                changes.mode = Some(preset.id.clone());
            }
        }
        for option in options {
            let category = option.category.as_ref();
            let is_model = matches!(category, Some(proto::SessionConfigOptionCategory::Model))
                || (category.is_none() && &*option.id.0 == "model");
            let is_mode = matches!(category, Some(proto::SessionConfigOptionCategory::Mode))
                || (category.is_none() && &*option.id.0 == "mode");
            let current = match &option.kind {
                proto::SessionConfigKind::Select(select) => Some(select.current_value.to_string()),
                _ => None,
            };
            if is_model
                && (self.model_option.is_none()
                    || self.model_option.as_deref() == Some(&option.id.0))
            {
                self.model_option = Some(option.id.to_string());
                if current.is_some() && current != self.current_model {
                    self.current_model.clone_from(&current);
                    changes.model = current;
                }
            } else if is_mode
                && (self.mode_option.is_none() || self.mode_option.as_deref() == Some(&option.id.0))
            {
                self.mode_option = Some(option.id.to_string());
                if self.presets.is_empty()
                    && !self.has_modes
                    && current.is_some()
                    && current != self.current_mode
                {
                    self.current_mode.clone_from(&current);
                    changes.mode = current;
                }
            }
        }
        changes
    }
}

// ---------------------------------------------------------------------------------------
// Tool calls
// ---------------------------------------------------------------------------------------

/// What is known of each tool call, so that partial updates yield complete events.
#[derive(Default)]
struct ToolTracker {
    calls: HashMap<String, ToolState>,
}

struct ToolState {
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

/// An ACP `diff` content item (`path`, `oldText` absent or null for a new file, `newText`).
/// Gemini sends `oldText: ""` for a new file and says so in `_meta.kind` (`add`).
fn acp_diff(item: &Value) -> Option<FileDiff> {
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

fn tool_kind_name(kind: ToolKind) -> &'static str {
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

fn tool_status(status: &str) -> Option<ToolStatus> {
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
fn id_string(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn take_string(value: Option<&mut Value>) -> Option<String> {
    match value.map(Value::take) {
        Some(Value::String(s)) => Some(s),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    }
}

/// The text of `{"type":"content","content":{"type":"text","text":…}}` items.
fn content_text(items: &[Value]) -> Option<String> {
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

impl ToolTracker {
    /// A permission request's `rawInput` for a call announced earlier with its arguments
    /// is the agent's view for the person asked (Copilot: `{fileName, diff}` for a
    /// `create{path, file_text}`): the call keeps the arguments it was announced with.
    fn keep_announced_input(&self, call: &mut Map<String, Value>) {
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
    fn apply(
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

// ---------------------------------------------------------------------------------------
// Inbound messages: session updates and permission requests
// ---------------------------------------------------------------------------------------

/// Claims `session/update` notifications and `session/request_permission` requests. Both
/// are read leniently from the raw JSON so that an agent's extra or unusual fields never
/// cost an event.
struct InboundHandler {
    shared: Arc<Shared>,
}

impl HandleDispatchFrom<acp::Agent> for InboundHandler {
    async fn handle_dispatch_from(
        &mut self,
        message: Dispatch,
        connection: acp::ConnectionTo<acp::Agent>,
    ) -> Result<Handled<Dispatch>, acp::Error> {
        match message {
            Dispatch::Notification(notification) if notification.method == "session/update" => {
                // Only an update the gate did not count reaches the SDK (see `gate`): no
                // credit to give back.
                self.shared.updates_seen.fetch_add(1, Ordering::AcqRel);
                let (_, params) = notification.into_parts();
                self.on_session_update(params).await;
                Ok(Handled::Yes)
            }
            Dispatch::Request(request, responder)
                if request.method == "session/request_permission" =>
            {
                let (_, params) = request.into_parts();
                self.on_permission_request(params, responder, &connection)
                    .await;
                Ok(Handled::Yes)
            }
            other => Ok(Handled::No {
                message: other,
                retry: false,
            }),
        }
    }

    fn describe_chain(&self) -> impl std::fmt::Debug {
        "agentry ACP session handler"
    }
}

impl InboundHandler {
    async fn on_session_update(&self, mut params: Value) {
        if self.shared.replaying.load(Ordering::Acquire) {
            return;
        }
        let Some(update) = params.get_mut("update").and_then(Value::as_object_mut) else {
            tracing::trace!("session/update without an update");
            return;
        };
        let tag = match update.get("sessionUpdate").and_then(Value::as_str) {
            Some(tag) => UpdateTag::of(tag),
            None => UpdateTag::Other,
        };
        let event = match tag {
            UpdateTag::MessageChunk | UpdateTag::ThoughtChunk => {
                let Some(text) = take_text_chunk(update) else {
                    return;
                };
                let id = take_string(update.get_mut("messageId"));
                if tag == UpdateTag::MessageChunk {
                    ProviderEvent::AssistantDelta {
                        message_id: id,
                        text,
                    }
                } else {
                    ProviderEvent::ReasoningDelta { id, text }
                }
            }
            UpdateTag::ToolCall | UpdateTag::ToolCallUpdate => {
                let replace = tag == UpdateTag::ToolCall;
                let Some((call, _)) = lock(&self.shared.tools).apply(update, replace) else {
                    tracing::trace!("tool call update without a toolCallId");
                    return;
                };
                ProviderEvent::ToolCall(call)
            }
            UpdateTag::Plan => {
                let entries = update
                    .get("entries")
                    .and_then(Value::as_array)
                    .map(|entries| {
                        entries
                            .iter()
                            .filter_map(|entry| {
                                Some(PlanEntry {
                                    text: entry.get("content")?.as_str()?.to_owned(),
                                    status: PlanStatus::parse(
                                        entry
                                            .get("status")
                                            .and_then(Value::as_str)
                                            .unwrap_or("pending"),
                                    ),
                                })
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                ProviderEvent::Plan { entries }
            }
            UpdateTag::ModeUpdate => {
                let Some(mode) = update
                    .get("currentModeId")
                    .or_else(|| update.get("modeId"))
                    .and_then(Value::as_str)
                else {
                    return;
                };
                let Some(mode) = lock(&self.shared.config).mode_reported(mode) else {
                    return;
                };
                if self.shared.starting.load(Ordering::Acquire) {
                    return;
                }
                ProviderEvent::ModeChanged { mode }
            }
            UpdateTag::ConfigUpdate => {
                let options = update
                    .get("configOptions")
                    .and_then(|v| Vec::<proto::SessionConfigOption>::deserialize(v).ok())
                    .unwrap_or_default();
                let changes = {
                    let mut config = lock(&self.shared.config);
                    let changes = config.absorb_options(&options);
                    if changes.mode.is_some() {
                        config.mode_reports += 1;
                    }
                    if changes.model.is_some() {
                        config.model_reports += 1;
                    }
                    changes
                };
                if self.shared.starting.load(Ordering::Acquire) {
                    return;
                }
                if let Some(mode) = changes.mode {
                    self.shared
                        .events
                        .emit(ProviderEvent::ModeChanged { mode })
                        .await;
                }
                match changes.model {
                    Some(model) => ProviderEvent::ModelChanged { model },
                    None => return,
                }
            }
            UpdateTag::Usage => {
                let used = update.get("used").and_then(Value::as_u64);
                let size = update.get("size").and_then(Value::as_u64);
                let cost = update.get("cost").and_then(|cost| {
                    let currency = cost.get("currency").and_then(Value::as_str);
                    if currency.is_none_or(|c| c.eq_ignore_ascii_case("usd")) {
                        cost.get("amount").and_then(Value::as_f64)
                    } else {
                        None
                    }
                });
                ProviderEvent::Usage(Usage {
                    context_window_used: used,
                    context_window_max: size,
                    cost_usd: cost,
                    ..Usage::default()
                })
            }
            UpdateTag::UserChunk | UpdateTag::Other => {
                tracing::trace!(kind = ?update.get("sessionUpdate"), "session update ignored");
                return;
            }
        };
        self.shared.events.emit(event).await;
    }

    async fn on_permission_request(
        &self,
        mut params: Value,
        responder: acp::Responder<Value>,
        connection: &acp::ConnectionTo<acp::Agent>,
    ) {
        // Nobody is asked during a history replay, nor after the turn was interrupted.
        if self.shared.replaying.load(Ordering::Acquire)
            || self.shared.interrupted.load(Ordering::Acquire)
        {
            let _ = responder.respond(permission_outcome(None));
            return;
        }
        let offered = params
            .get("options")
            .and_then(Value::as_array)
            .map(|options| permission_options(options))
            .unwrap_or_default();
        let mut call = match params.get_mut("toolCall").map(Value::take) {
            Some(Value::Object(call)) => call,
            _ => Map::new(),
        };
        let call_id = call.get("toolCallId").and_then(id_string);
        let mut title = call.get("title").and_then(Value::as_str).map(str::to_owned);
        let mut input = call.get("rawInput").filter(|v| !v.is_null()).cloned();
        // Some agents (Gemini) announce the tool call only here: report it first.
        let tool_update = {
            let mut tools = lock(&self.shared.tools);
            tools.keep_announced_input(&mut call);
            tools.apply(&mut call, false)
        };
        if let Some((update, changed)) = tool_update {
            // What the request leaves out, the earlier `tool_call` may have said.
            if title.is_none() && update.title != update.name {
                title = Some(update.title.clone());
            }
            if input.is_none() && update.input.as_object().is_none_or(|o| !o.is_empty()) {
                input = Some(update.input.clone());
            }
            if changed {
                self.shared
                    .events
                    .emit(ProviderEvent::ToolCall(update))
                    .await;
            }
        }
        if offered.is_empty() {
            tracing::warn!("permission request without usable options; answering cancelled");
            let _ = responder.respond(permission_outcome(None));
            return;
        }

        let (reply, decision) = oneshot::channel();
        let mut epoch = self.shared.permission_epoch.subscribe();
        let asked_at = *epoch.borrow_and_update();
        self.shared
            .events
            .emit(ProviderEvent::PermissionRequested(PermissionRequest {
                provider_request_id: responder.raw_id().to_string(),
                kind: PermissionKind::Tool,
                title: title.unwrap_or_else(|| "Permission requested".to_owned()),
                call_id,
                input,
                options: offered.iter().map(|(option, _)| option.clone()).collect(),
                reply,
            }))
            .await;

        // Wait for the answer off the dispatch loop: updates keep flowing meanwhile.
        let waiting = async move {
            let chosen = tokio::select! {
                decision = decision => match decision {
                    Ok(PermissionDecision::Selected { option_id, behavior, .. }) => {
                        provider_option(&offered, &option_id, behavior)
                    }
                    Ok(PermissionDecision::Cancelled) | Err(_) => None,
                },
                _ = epoch.wait_for(|now| *now != asked_at) => None,
            };
            let _ = responder.respond(permission_outcome(chosen));
            Ok(())
        };
        if let Err(e) = connection.spawn(waiting) {
            tracing::warn!(error = %e.message, "could not wait for a permission answer");
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum UpdateTag {
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
    fn of(tag: &str) -> Self {
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
fn take_text_chunk(update: &mut Map<String, Value>) -> Option<String> {
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
fn permission_options(options: &[Value]) -> Vec<(PermissionOption, String)> {
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
fn provider_option(
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

fn permission_outcome(option_id: Option<String>) -> Value {
    let outcome = match option_id {
        Some(id) => {
            proto::RequestPermissionOutcome::Selected(proto::SelectedPermissionOutcome::new(id))
        }
        None => proto::RequestPermissionOutcome::Cancelled,
    };
    serde_json::to_value(proto::RequestPermissionResponse::new(outcome))
        .unwrap_or_else(|_| json!({"outcome": {"outcome": "cancelled"}}))
}

// ---------------------------------------------------------------------------------------
// File requests, confined to the workspace
// ---------------------------------------------------------------------------------------

fn io_error(path: &Path, e: &std::io::Error) -> acp::Error {
    let code = if e.kind() == std::io::ErrorKind::NotFound {
        acp::ErrorCode::RESOURCE_NOT_FOUND
    } else {
        acp::ErrorCode::INTERNAL_ERROR
    };
    acp::Error::new(code, format!("{}: {e}", path.display()))
}

fn file_error(path: &Path, e: super::workspace_files::FileError) -> acp::Error {
    match e {
        super::workspace_files::FileError::Refused(why) => acp::Error::new(
            acp::ErrorCode::INVALID_PARAMS,
            format!("{}: {why}", path.display()),
        ),
        super::workspace_files::FileError::Io(e) => io_error(path, &e),
    }
}

async fn read_text_file(
    root: &Path,
    request: &proto::ReadTextFileRequest,
) -> Result<String, acp::Error> {
    let relative = super::workspace_files::relative_to(root, &request.path)
        .map_err(|e| file_error(&request.path, e))?;
    let text = super::workspace_files::read(root, &relative)
        .await
        .map_err(|e| file_error(&request.path, e))?;
    if request.line.is_none() && request.limit.is_none() {
        return Ok(text);
    }
    let skip = request
        .line
        .map_or(0, |line| line.saturating_sub(1) as usize);
    let take = request.limit.map_or(usize::MAX, |limit| limit as usize);
    Ok(text.split_inclusive('\n').skip(skip).take(take).collect())
}

/// Writes through [`super::workspace_files`]: no `.git` component, no symlink out of
/// the workspace, nothing written when refused.
async fn write_text_file(
    root: &Path,
    request: &proto::WriteTextFileRequest,
) -> Result<(), acp::Error> {
    let relative = super::workspace_files::relative_to(root, &request.path)
        .map_err(|e| file_error(&request.path, e))?;
    super::workspace_files::write(root, &relative, request.content.as_bytes().to_vec())
        .await
        .map_err(|e| file_error(&request.path, e))
}

// ---------------------------------------------------------------------------------------
// Starting a session
// ---------------------------------------------------------------------------------------

/// What the handshake offers and may do, from the provider's configuration.
struct Handshake {
    serve_reads: bool,
    auth_method: Option<String>,
    /// Where the modes and models the agent announces are kept.
    announced: Arc<Mutex<Announced>>,
    /// The session's model is given on the command line (`model_flag`): the model an
    /// answer calls current is not taken as the session's.
    model_flagged: bool,
}

/// What the handshake established.
struct Established {
    connection: acp::v1::ConnectionTo<acp::Agent>,
    session_id: String,
    resumed: bool,
}

/// Turn the `mcp_servers` of a spec into ACP declarations, skipping what cannot be sent.
fn mcp_servers(
    servers: &BTreeMap<String, Value>,
    caps: &proto::McpCapabilities,
) -> Vec<proto::McpServer> {
    fn pairs(value: Option<&Value>) -> Vec<(String, String)> {
        let text = |v: &Value| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        match value {
            Some(Value::Object(map)) => map.iter().map(|(k, v)| (k.clone(), text(v))).collect(),
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(|item| {
                    Some((
                        item.get("name")?.as_str()?.to_owned(),
                        text(item.get("value")?),
                    ))
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    let mut out = Vec::new();
    for (name, server) in servers {
        let kind = server.get("type").and_then(Value::as_str);
        match kind {
            Some("http" | "sse") => {
                let Some(url) = server.get("url").and_then(Value::as_str) else {
                    tracing::warn!(server = %name, "MCP server without a url; skipped");
                    continue;
                };
                let headers: Vec<proto::HttpHeader> = pairs(server.get("headers"))
                    .into_iter()
                    .map(|(k, v)| proto::HttpHeader::new(k, v))
                    .collect();
                if kind == Some("http") {
                    if !caps.http {
                        tracing::warn!(server = %name, "the agent does not take HTTP MCP servers; skipped");
                        continue;
                    }
                    out.push(proto::McpServer::Http(
                        proto::McpServerHttp::new(name, url).headers(headers),
                    ));
                } else {
                    if !caps.sse {
                        tracing::warn!(server = %name, "the agent does not take SSE MCP servers; skipped");
                        continue;
                    }
                    out.push(proto::McpServer::Sse(
                        proto::McpServerSse::new(name, url).headers(headers),
                    ));
                }
            }
            None | Some("stdio" | "local") => {
                let strings = |value: Option<&Value>| -> Vec<String> {
                    value
                        .and_then(Value::as_array)
                        .map(|items| {
                            items
                                .iter()
                                .map(|a| a.as_str().map_or_else(|| a.to_string(), str::to_owned))
                                .collect()
                        })
                        .unwrap_or_default()
                };
                // `command` is a program, or a whole argv.
                let (command, mut args) = match server.get("command") {
                    Some(Value::String(command)) => (command.clone(), Vec::new()),
                    argv @ Some(Value::Array(_)) => {
                        let mut argv = strings(argv).into_iter();
                        match argv.next() {
                            Some(command) => (command, argv.collect()),
                            None => (String::new(), Vec::new()),
                        }
                    }
                    _ => (String::new(), Vec::new()),
                };
                if command.is_empty() {
                    tracing::warn!(server = %name, "MCP server without a command; skipped");
                    continue;
                }
                args.extend(strings(server.get("args")));
                let env = pairs(server.get("env"))
                    .into_iter()
                    .map(|(k, v)| proto::EnvVariable::new(k, v))
                    .collect();
                out.push(proto::McpServer::Stdio(
                    proto::McpServerStdio::new(name, command)
                        .args(args)
                        .env(env),
                ));
            }
            Some(other) => {
                tracing::warn!(server = %name, kind = other, "unknown MCP server type; skipped");
            }
        }
    }
    out
}

fn request_error(what: &str, e: &acp::Error) -> ProviderError {
    if acp::is_incoming_transport_closed(e) || acp::is_connection_terminated(e) {
        ProviderError::Gone
    } else {
        ProviderError::Protocol(format!("{what}: {}", e.message))
    }
}

/// Initialize the agent and open (or reopen) the session.
async fn establish(
    connection: &acp::v1::ConnectionTo<acp::Agent>,
    spec: &SessionSpec,
    shared: &Arc<Shared>,
    handshake: &Handshake,
) -> Result<Established, ProviderError> {
    let serve_reads = handshake.serve_reads;
    let init = connection
        .send_request(
            proto::InitializeRequest::new(acp::schema::ProtocolVersion::V1)
                .client_capabilities(
                    proto::ClientCapabilities::new()
                        .fs(proto::FileSystemCapabilities::new()
                            .read_text_file(serve_reads)
                            .write_text_file(true))
                        .terminal(false),
                )
                .client_info(proto::Implementation::new(
                    "agentry",
                    env!("CARGO_PKG_VERSION"),
                )),
        )
        .block_task()
        .await
        .map_err(|e| request_error("initialize failed", &e))?;
    // From here on the SDK hands every `session/update` to our handler.
    shared.update_credits.arm();
    let caps = init.agent_capabilities;
    let servers = mcp_servers(&spec.mcp_servers, &caps.mcp_capabilities);
    let system_prompt = match &spec.system_prompt {
        Some(text) if caps.session_capabilities.system_prompt.is_some() => Some(
            proto::SystemPrompt::new(vec![proto::ContentBlock::from(text.clone())]),
        ),
        Some(_) => {
            tracing::debug!("the agent takes no system prompt; it is not sent");
            None
        }
        None => None,
    };

    let resume_id = spec
        .resume
        .as_ref()
        .and_then(|handle| handle.get("session_id"))
        .and_then(Value::as_str)
        .map(str::to_owned);
    let mut opened: Option<(
        String,
        Option<proto::SessionModeState>,
        Option<Vec<proto::SessionConfigOption>>,
    )> = None;
    if let Some(id) = resume_id {
        let attempt = if caps.load_session {
            let mut loaded = load_session(
                connection,
                shared,
                handshake,
                &id,
                spec,
                &servers,
                &system_prompt,
            )
            .await;
            if matches!(&loaded, Err(e) if e.code == acp::ErrorCode::AUTH_REQUIRED)
                && authenticate(connection, handshake).await
            {
                loaded = load_session(
                    connection,
                    shared,
                    handshake,
                    &id,
                    spec,
                    &servers,
                    &system_prompt,
                )
                .await;
            }
            loaded.map_err(|e| e.message)
        } else if caps.session_capabilities.resume.is_some() {
            let request = proto::ResumeSessionRequest::new(id.clone(), spec.cwd.clone())
                .mcp_servers(servers.clone())
                .system_prompt(system_prompt.clone());
            connection
                .send_request(request)
                .block_task()
                .await
                .map(|r| (r.modes, r.config_options))
                .map_err(|e| e.message)
        } else {
            Err("the agent cannot reopen sessions".to_owned())
        };
        match attempt {
            Ok((modes, options)) => opened = Some((id, modes, options)),
            Err(message) => {
                if connection.termination().is_some() || connection.is_incoming_closed() {
                    return Err(ProviderError::Gone);
                }
                tracing::warn!(session = %id, error = %message, "could not reopen the session; starting a new one");
                shared
                    .events
                    .emit(ProviderEvent::Error {
                        message: format!(
                            "the earlier conversation could not be loaded ({message}); a new session was started"
                        ),
                        code: Some("resume_failed".to_owned()),
                    })
                    .await;
            }
        }
    }
    let resumed = opened.is_some();
    let (session_id, modes, options) = match opened {
        Some(opened) => opened,
        None => {
            let request = proto::NewSessionRequest::new(spec.cwd.clone())
                .mcp_servers(servers)
                .system_prompt(system_prompt);
            // Sent untyped: the answer's `models` is not in the typed schema.
            let request = UntypedMessage::new("session/new", &request)
                .map_err(|e| ProviderError::Protocol(e.message))?;
            let mut created = connection.send_request(request.clone()).block_task().await;
            if matches!(&created, Err(e) if e.code == acp::ErrorCode::AUTH_REQUIRED)
                && authenticate(connection, handshake).await
            {
                created = connection.send_request(request).block_task().await;
            }
            let answer = created.map_err(|e| request_error("session/new failed", &e))?;
            let response: proto::NewSessionResponse = serde_json::from_value(answer.clone())
                .map_err(|e| {
                    ProviderError::Protocol(format!("session/new answered unreadably: {e}"))
                })?;
            announce(shared, handshake, &answer);
            (
                response.session_id.to_string(),
                response.modes,
                response.config_options,
            )
        }
    };
    {
        let mut config = lock(&shared.config);
        config.absorb_modes(modes.as_ref());
        config.absorb_options(options.as_deref().unwrap_or_default());
    }

    if let Some(mode) = &spec.mode
        && lock(&shared.config).current_mode.as_deref() != Some(mode.as_str())
        && let Err(e) = change_mode(connection, shared, &session_id, mode).await
    {
        shared
            .events
            .emit(ProviderEvent::Error {
                message: format!("the mode `{mode}` could not be set: {e}"),
                code: Some("set_mode_failed".to_owned()),
            })
            .await;
    }
    if let Some(model) = &spec.model
        && lock(&shared.config).current_model.as_deref() != Some(model.as_str())
    {
        let option = lock(&shared.config).model_option.clone();
        let result = match option {
            Some(option) => change_model(connection, shared, &session_id, &option, model).await,
            None => set_model_request(connection, shared, &session_id, model).await,
        };
        if let Err(e) = result {
            shared
                .events
                .emit(ProviderEvent::Error {
                    message: format!("the model `{model}` could not be set: {e}"),
                    code: Some("set_model_failed".to_owned()),
                })
                .await;
        }
    }
    shared.starting.store(false, Ordering::Release);
    Ok(Established {
        connection: connection.clone(),
        session_id,
        resumed,
    })
}

type Reopened = (
    Option<proto::SessionModeState>,
    Option<Vec<proto::SessionConfigOption>>,
);

/// Keep what a session answer announces; its current model is the session's when the
/// model is not given on the command line nor a config option.
fn announce(shared: &Shared, handshake: &Handshake, answer: &Value) {
    lock(&handshake.announced).absorb(answer);
    if handshake.model_flagged {
        return;
    }
    if let Some(current) = answer
        .pointer("/models/currentModelId")
        .and_then(Value::as_str)
    {
        let mut config = lock(&shared.config);
        if config.current_model.is_none() && config.model_option.is_none() {
            config.current_model = Some(current.to_owned());
        }
    }
}

/// `session/load`, dropping the history the agent replays before it answers.
async fn load_session(
    connection: &acp::v1::ConnectionTo<acp::Agent>,
    shared: &Arc<Shared>,
    handshake: &Handshake,
    id: &str,
    spec: &SessionSpec,
    servers: &[proto::McpServer],
    system_prompt: &Option<proto::SystemPrompt>,
) -> Result<Reopened, acp::Error> {
    let request = proto::LoadSessionRequest::new(id.to_owned(), spec.cwd.clone())
        .mcp_servers(servers.to_vec())
        .system_prompt(system_prompt.clone());
    // Sent untyped: the answer's `models` is not in the typed schema.
    let request = UntypedMessage::new("session/load", &request)?;
    let (answered, answer) = oneshot::channel();
    shared.replaying.store(true, Ordering::Release);
    let sent = connection
        .prepare_request(request)
        .on_receiving_result(move |result| async move {
            let _ = answered.send(result);
            Ok(())
        });
    let result = match sent {
        Ok(()) => answer
            .await
            .unwrap_or_else(|_| Err(acp::Error::internal_error())),
        Err(e) => Err(e),
    };
    // Some agents (Gemini) answer first and replay the history after the answer: the
    // replay is over once the agent has been quiet for a moment. No prompt can be sent
    // before the session is handed out, so nothing live is dropped.
    if result.is_ok() {
        let settle = async {
            loop {
                let seen = shared.updates_seen.load(Ordering::Acquire);
                tokio::time::sleep(REPLAY_QUIET).await;
                if shared.updates_seen.load(Ordering::Acquire) == seen {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(REPLAY_SETTLE_MAX, settle).await;
    }
    shared.replaying.store(false, Ordering::Release);
    lock(&shared.tools).calls.clear();
    let answer = result?;
    announce(shared, handshake, &answer);
    let response: proto::LoadSessionResponse = serde_json::from_value(answer)?;
    Ok((response.modes, response.config_options))
}

/// `authenticate` with the configured method, if there is one; whether it succeeded.
async fn authenticate(
    connection: &acp::v1::ConnectionTo<acp::Agent>,
    handshake: &Handshake,
) -> bool {
    let Some(method) = &handshake.auth_method else {
        return false;
    };
    match connection
        .send_request(proto::AuthenticateRequest::new(method.clone()))
        .block_task()
        .await
    {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!(method = %method, error = %e.message, "authenticate failed");
            false
        }
    }
}

/// Ask the agent for another mode, through `session/set_mode` or its mode config option.
/// Emits `ModeChanged` unless the agent already reported the change itself.
async fn change_mode(
    connection: &acp::v1::ConnectionTo<acp::Agent>,
    shared: &Shared,
    session_id: &str,
    mode: &str,
) -> Result<(), ProviderError> {
    let (option, preset, reports_before) = {
        let config = lock(&shared.config);
        let preset = match config.presets.iter().find(|p| p.id == mode) {
            Some(preset) => Some(
                presets::changes_for(preset, &config.options)
                    .map_err(|e| ProviderError::Protocol(format!("mode `{mode}`: {e}")))?,
            ),
            None => None,
        };
        let option = if config.has_modes {
            None
        } else {
            config.mode_option.clone()
        };
        (option, preset, config.mode_reports)
    };
    if let Some(changes) = preset {
        // One option after the other, in the preset's order.
        for (option, value) in changes {
            let response = connection
                .send_request(proto::SetSessionConfigOptionRequest::new(
                    session_id.to_owned(),
                    option,
                    value,
                ))
                .block_task()
                .await
                .map_err(|e| request_error("session/set_config_option failed", &e))?;
            let model = lock(&shared.config)
                .absorb_options(&response.config_options)
                .model;
            if let Some(model) = model {
                shared
                    .report_change(ProviderEvent::ModelChanged { model })
                    .await;
            }
        }
    } else {
        match option {
            Some(option) => {
                let response = connection
                    .send_request(proto::SetSessionConfigOptionRequest::new(
                        session_id.to_owned(),
                        option,
                        mode,
                    ))
                    .block_task()
                    .await
                    .map_err(|e| request_error("session/set_config_option failed", &e))?;
                let model = {
                    let mut config = lock(&shared.config);
                    let changes = config.absorb_options(&response.config_options);
                    changes.model
                };
                if let Some(model) = model {
                    shared
                        .report_change(ProviderEvent::ModelChanged { model })
                        .await;
                }
            }
            None => {
                connection
                    .send_request(proto::SetSessionModeRequest::new(
                        session_id.to_owned(),
                        mode.to_owned(),
                    ))
                    .block_task()
                    .await
                    .map_err(|e| request_error("session/set_mode failed", &e))?;
            }
        }
    }
    let report = {
        let mut config = lock(&shared.config);
        let already =
            config.mode_reports != reports_before && config.current_mode.as_deref() == Some(mode);
        config.current_mode = Some(mode.to_owned());
        !already
    };
    if report {
        shared
            .report_change(ProviderEvent::ModeChanged {
                mode: mode.to_owned(),
            })
            .await;
    }
    Ok(())
}

/// Set the model through the agent's model config option. Emits `ModelChanged` unless
/// the agent already reported the change itself.
async fn change_model(
    connection: &acp::v1::ConnectionTo<acp::Agent>,
    shared: &Shared,
    session_id: &str,
    option: &str,
    model: &str,
) -> Result<(), ProviderError> {
    let reports_before = lock(&shared.config).model_reports;
    let response = connection
        .send_request(proto::SetSessionConfigOptionRequest::new(
            session_id.to_owned(),
            option.to_owned(),
            proto::SessionConfigOptionValue::value_id(model.to_owned()),
        ))
        .block_task()
        .await
        .map_err(|e| request_error("session/set_config_option failed", &e))?;
    let (report, mode) = {
        let mut config = lock(&shared.config);
        let already = config.model_reports != reports_before
            && config.current_model.as_deref() == Some(model);
        let changes = config.absorb_options(&response.config_options);
        config.current_model = Some(model.to_owned());
        (!already, changes.mode)
    };
    if let Some(mode) = mode {
        shared
            .report_change(ProviderEvent::ModeChanged { mode })
            .await;
    }
    if report {
        shared
            .report_change(ProviderEvent::ModelChanged {
                model: model.to_owned(),
            })
            .await;
    }
    Ok(())
}

/// `session/set_model`, outside the current schema but still answered by agents that
/// report no model config option (Gemini).
async fn set_model_request(
    connection: &acp::v1::ConnectionTo<acp::Agent>,
    shared: &Shared,
    session_id: &str,
    model: &str,
) -> Result<(), ProviderError> {
    let request = UntypedMessage::new(
        "session/set_model",
        json!({"sessionId": session_id, "modelId": model}),
    )
    .map_err(|e| ProviderError::Protocol(e.message))?;
    connection
        .send_request(request)
        .block_task()
        .await
        .map_err(|e| {
            if e.code == acp::ErrorCode::METHOD_NOT_FOUND {
                ProviderError::Unsupported("changing the model")
            } else {
                request_error("session/set_model failed", &e)
            }
        })?;
    lock(&shared.config).current_model = Some(model.to_owned());
    shared
        .report_change(ProviderEvent::ModelChanged {
            model: model.to_owned(),
        })
        .await;
    Ok(())
}

async fn start_session(
    cfg: &AcpProviderConfig,
    presets: Arc<[ModePreset]>,
    announced: Arc<Mutex<Announced>>,
    spec: SessionSpec,
    launcher: Arc<dyn ProcessLauncher>,
    events: EventSink,
) -> Result<(Box<dyn ProviderSession>, SessionInfo), ProviderError> {
    let Some((program, args)) = cfg.command.split_first() else {
        return Err(ProviderError::Unavailable(
            "no command is configured".to_owned(),
        ));
    };
    let mut args = args.to_vec();
    let flagged_model = match (&cfg.model_flag, &spec.model) {
        (Some(flag), Some(model)) => {
            args.push(flag.clone());
            args.push(model.clone());
            Some(model.clone())
        }
        _ => None,
    };
    let mut child = launcher
        .launch(CommandSpec {
            program: program.clone(),
            args,
            cwd: spec.cwd.clone(),
            env: cfg.env.clone(),
            pass_env: cfg.pass_env.clone(),
            secret_env: Default::default(),
            wraps: None,
            serves: None,
        })
        .await?;
    let pid = child.pid();
    let Some((stdin, stdout, stderr)) = child.take_stdio().await else {
        return Err(ProviderError::Protocol(
            "the agent process has no piped stdio".to_owned(),
        ));
    };

    let (stderr_ring, stderr_task) =
        StderrTail::capture_masked(stderr, "agentry::providers::acp::stderr", child.redactor());
    let update_credits = Arc::new(UpdateCredits::new(UPDATES_IN_FLIGHT));
    let (gate, update_lane) = UpdateGate::new(stdout, update_credits.clone());
    let (stdout, to_sdk) = tokio::io::duplex(SDK_PIPE_BYTES);
    let shared = Arc::new(Shared {
        events: Emitter::new(events),
        root: std::fs::canonicalize(&spec.cwd).unwrap_or_else(|_| spec.cwd.clone()),
        replaying: AtomicBool::new(false),
        updates_seen: AtomicU64::new(0),
        starting: AtomicBool::new(true),
        tools: Mutex::new(ToolTracker::default()),
        config: Mutex::new(ConfigState {
            presets,
            // Started on it: no need to ask for it again.
            current_model: flagged_model,
            ..ConfigState::default()
        }),
        permission_epoch: watch::channel(0).0,
        turn_active: AtomicBool::new(false),
        interrupted: AtomicBool::new(false),
        closing: AtomicBool::new(false),
        stderr: stderr_ring,
        update_credits,
    });

    let (established_tx, established_rx) = oneshot::channel::<Result<Established, ProviderError>>();
    let (
        mut stopper,
        StopSignals {
            close: close_rx,
            done: done_tx,
        },
    ) = Stopper::new();
    let transport = acp::ByteStreams::new(stdin.compat_write(), stdout.compat());
    let handshake = Handshake {
        serve_reads: cfg.serve_reads,
        auth_method: cfg.auth_method.clone(),
        announced,
        model_flagged: cfg.model_flag.is_some(),
    };
    let read_root = shared.clone();
    let write_root = shared.clone();
    let foreground_shared = shared.clone();
    let connection =
        acp::Client
            .v1()
            .name("agentry")
            .with_handler(InboundHandler {
                shared: shared.clone(),
            })
            .on_receive_request(
                async move |request: proto::ReadTextFileRequest, responder, _cx| {
                    match read_text_file(&read_root.root, &request).await {
                        Ok(content) => responder.respond(proto::ReadTextFileResponse::new(content)),
                        Err(e) => responder.respond_with_error(e),
                    }
                },
                acp::on_receive_request!(),
            )
            .on_receive_request(
                async move |request: proto::WriteTextFileRequest, responder, _cx| {
                    match write_text_file(&write_root.root, &request).await {
                        Ok(()) => responder.respond(proto::WriteTextFileResponse::new()),
                        Err(e) => responder.respond_with_error(e),
                    }
                },
                acp::on_receive_request!(),
            )
            .connect_with(transport, async move |cx| {
                let mut established_tx = established_tx;
                let setup = tokio::time::timeout(
                    START_TIMEOUT,
                    establish(&cx, &spec, &foreground_shared, &handshake),
                );
                let outcome = tokio::select! {
                    outcome = setup => outcome.unwrap_or_else(|_| {
                        Err(ProviderError::Protocol(format!(
                            "the agent did not start within {} s",
                            START_TIMEOUT.as_secs()
                        )))
                    }),
                    // Nobody waits for the session any more: stop.
                    () = established_tx.closed() => return Ok(()),
                };
                let ready = outcome.is_ok();
                if established_tx.send(outcome).is_err() || !ready {
                    return Ok(());
                }
                // Serve until we close the session or the agent's output ends.
                tokio::select! {
                    _ = close_rx => {}
                    () = cx.incoming_closed() => {}
                }
                Ok(())
            });

    let pump = tokio::spawn(pump(
        gate,
        to_sdk,
        handle_updates(
            update_lane,
            InboundHandler {
                shared: shared.clone(),
            },
        ),
    ));

    let (started_tx, started_rx) = oneshot::channel();
    tokio::spawn(supervise(
        connection,
        child,
        stderr_task,
        shared.clone(),
        Supervision {
            done: done_tx,
            started: started_rx,
            pump,
        },
    ));

    let failure = match established_rx.await {
        Ok(Ok(established)) => {
            let (current_mode, current_model) = {
                let config = lock(&shared.config);
                (config.current_mode.clone(), config.current_model.clone())
            };
            let info = SessionInfo {
                provider_session_id: Some(established.session_id.clone()),
                persistence: Some(json!({ "session_id": established.session_id })),
                pid: Some(pid),
                resumed: established.resumed,
                current_mode,
                current_model,
            };
            let session = AcpSession {
                session_id: established.session_id,
                connection: established.connection,
                shared,
                stopper,
            };
            let _ = started_tx.send(());
            return Ok((Box::new(session), info));
        }
        Ok(Err(e)) => Some(e),
        Err(_) => None,
    };
    // The session never started: no events (`started_tx` is dropped), stop the process,
    // explain why.
    drop(started_tx);
    shared.events.close().await;
    let exit = stopper.stop(&shared.closing).await;
    Err(match failure {
        Some(ProviderError::Gone) | None => ProviderError::Protocol(if exit.is_empty() {
            "the agent stopped while starting".to_owned()
        } else {
            format!("the agent stopped while starting: {exit}")
        }),
        Some(ProviderError::Protocol(message)) if !exit.is_empty() => {
            ProviderError::Protocol(format!("{message} ({exit})"))
        }
        Some(other) => other,
    })
}

/// Handle the updates the gate took out of the SDK's stream, in wire order, each as one
/// parse of its line (see `gate`).
async fn handle_updates(mut lane: gate::UpdateLane, handler: InboundHandler) {
    #[derive(Deserialize)]
    struct Notification {
        #[serde(default)]
        params: Value,
    }
    while let Some(line) = lane.recv().await {
        let _handled = gate::UpdateHandled(&handler.shared.update_credits);
        handler.shared.updates_seen.fetch_add(1, Ordering::AcqRel);
        // The gate let only a well-formed notification through.
        let params = serde_json::from_slice::<Notification>(&line)
            .map(|n| n.params)
            .unwrap_or_default();
        handler.on_session_update(params).await;
    }
}

/// Moves the agent's stdout through the gate: updates to `updates` (the lane's reader),
/// everything else into the SDK's pipe. Ends at the end of the output, once every update
/// is handled and the SDK has been given the rest, or when the SDK's end of the pipe is
/// gone.
async fn pump(
    mut gate: UpdateGate<tokio::process::ChildStdout>,
    mut to_sdk: tokio::io::DuplexStream,
    updates: impl Future<Output = ()>,
) {
    use tokio::io::AsyncWriteExt as _;
    let forward = async move {
        // An error means the SDK's end is gone (the connection ended): nothing to hand on.
        if tokio::io::copy(&mut gate, &mut to_sdk).await.is_ok() {
            let _ = to_sdk.shutdown().await;
        }
        // Dropping the gate ends the lane, and with it `updates`.
    };
    tokio::join!(forward, updates);
}

/// How the supervisor reports the end of the process.
struct Supervision {
    /// Gets how the process ended, once it has been reaped.
    done: oneshot::Sender<String>,
    /// Resolves once `start` has handed the session out; dropped if it never does, and
    /// then nothing is reported as an event.
    started: oneshot::Receiver<()>,
    /// The task that moves the agent's output through the gate: ended before `Exited`,
    /// so no update is reported after it.
    pump: tokio::task::JoinHandle<()>,
}

/// Owns the connection and the process: runs them until either ends, reaps the process,
/// then reports how it ended (to `done` and, last of all, as `Exited`).
async fn supervise<F>(
    connection: F,
    mut child: ManagedChild,
    stderr_task: StderrReader,
    shared: Arc<Shared>,
    report: Supervision,
) where
    F: Future<Output = Result<(), acp::Error>> + Send,
{
    let mut connection = Box::pin(connection);
    let mut status: Option<ExitStatus> = None;
    let mut broken: Option<String> = None;
    tokio::select! {
        result = &mut connection => {
            if let Err(e) = result {
                broken = Some(e.message);
            }
        }
        waited = child.wait() => {
            status = waited.ok();
            // Let the connection read what the process wrote before it ended.
            if let Ok(Err(e)) = tokio::time::timeout(DRAIN_AFTER_EXIT, &mut connection).await {
                broken = Some(e.message);
            }
        }
    }
    // Dropping the connection closes the agent's stdin.
    drop(connection);
    let status = child.wind_down(status, EXIT_AFTER_EOF).await;
    report.pump.abort();
    let _ = report.pump.await;
    stderr_task.settle().await;
    let reason = describe_exit(status, broken.as_deref(), &shared.stderr_tail());
    report_exit(
        &shared.events,
        report.done,
        report.started,
        reason,
        &shared.closing,
        "acp",
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// The live session
// ---------------------------------------------------------------------------------------

struct AcpSession {
    session_id: String,
    connection: acp::v1::ConnectionTo<acp::Agent>,
    shared: Arc<Shared>,
    stopper: Stopper,
}

impl AcpSession {
    fn is_gone(&self) -> bool {
        self.connection.termination().is_some() || self.connection.is_incoming_closed()
    }
}

/// The usage an agent put in its `session/prompt` answer: `usage` (Copilot, OpenCode) or
/// `_meta.quota.token_count` (Gemini, the turn's sum over its model calls).
fn prompt_usage(response: &Value) -> Option<Usage> {
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
fn turn_end(result: Result<Value, acp::Error>, interrupted: bool) -> Option<ProviderEvent> {
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

#[async_trait]
impl ProviderSession for AcpSession {
    async fn prompt(&mut self, input: TurnInput) -> Result<(), ProviderError> {
        if self.is_gone() {
            return Err(ProviderError::Gone);
        }
        if self.shared.turn_active.swap(true, Ordering::AcqRel) {
            return Err(ProviderError::Protocol(
                "a turn is already running".to_owned(),
            ));
        }
        self.shared.interrupted.store(false, Ordering::Release);
        let request = proto::PromptRequest::new(
            self.session_id.clone(),
            vec![proto::ContentBlock::Text(proto::TextContent::new(
                input.text,
            ))],
        );
        // Sent untyped so that fields outside the stable schema (usage) are kept.
        let request = match UntypedMessage::new("session/prompt", request) {
            Ok(request) => request,
            Err(e) => {
                self.shared.turn_active.store(false, Ordering::Release);
                return Err(ProviderError::Protocol(e.message));
            }
        };
        let shared = self.shared.clone();
        let sent = self
            .connection
            .prepare_request(request)
            .on_receiving_result(move |result| async move {
                shared.turn_active.store(false, Ordering::Release);
                lock(&shared.tools).calls.clear();
                if let Some(event) = turn_end(result, shared.interrupted.load(Ordering::Acquire)) {
                    shared.events.emit(event).await;
                }
                Ok(())
            });
        sent.map_err(|e| {
            self.shared.turn_active.store(false, Ordering::Release);
            request_error("session/prompt failed", &e)
        })
    }

    async fn interrupt(&mut self) -> Result<(), ProviderError> {
        self.shared.interrupted.store(true, Ordering::Release);
        let sent = self
            .connection
            .send_notification(proto::CancelNotification::new(self.session_id.clone()));
        // The protocol wants every pending permission request answered `cancelled`.
        self.shared
            .permission_epoch
            .send_modify(|epoch| *epoch += 1);
        sent.map_err(|e| request_error("session/cancel failed", &e))
    }

    async fn set_mode(&mut self, mode: &str) -> Result<(), ProviderError> {
        change_mode(&self.connection, &self.shared, &self.session_id, mode).await
    }

    async fn set_model(&mut self, model: &str) -> Result<(), ProviderError> {
        let option = lock(&self.shared.config).model_option.clone();
        let Some(option) = option else {
            return set_model_request(&self.connection, &self.shared, &self.session_id, model)
                .await;
        };
        change_model(
            &self.connection,
            &self.shared,
            &self.session_id,
            &option,
            model,
        )
        .await
    }

    async fn close(mut self: Box<Self>) {
        self.stopper.stop(&self.shared.closing).await;
    }
}

impl Drop for AcpSession {
    fn drop(&mut self) {
        // Dropping the close sender stops the connection; the process goes with it.
        self.shared.closing.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => unreachable!(),
        }
    }

    #[test]
    fn announced_modes_and_models_are_read_from_either_shape() {
        let ids = |a: &Announced| {
            (
                a.modes.iter().map(|m| m.id.clone()).collect::<Vec<_>>(),
                a.models
                    .iter()
                    .map(|m| (m.id.clone(), m.is_default))
                    .collect::<Vec<_>>(),
            )
        };
        let mut a = Announced::default();
        a.absorb(&json!({
            "modes": {"currentModeId": "ask", "availableModes": [{"id": "ask", "name": "Ask"}, {"id": "code"}]},
            "models": {"currentModelId": "b", "availableModels": [{"modelId": "a", "name": "A"}, {"modelId": "b"}]}
        }));
        assert_eq!(
            ids(&a),
            (
                vec!["ask".to_owned(), "code".to_owned()],
                vec![("a".to_owned(), false), ("b".to_owned(), true)]
            )
        );
        assert_eq!(a.modes[1].label, "code");
        // Config options (codex-acp), a grouped select among them; what an answer leaves
        // out is kept.
        a.absorb(&json!({"configOptions": [
            {"id": "effort", "category": "thought_level", "type": "select", "currentValue": "low",
             "options": [{"value": "low", "name": "Low"}]},
            {"id": "model", "category": "model", "type": "select", "currentValue": "y",
             "options": [{"group": "g", "name": "G", "options": [{"value": "x", "name": "X"}, {"value": "y", "name": "Y"}]}]}
        ]}));
        assert_eq!(
            ids(&a),
            (
                vec!["ask".to_owned(), "code".to_owned()],
                vec![("x".to_owned(), false), ("y".to_owned(), true)]
            )
        );
        a.absorb(
            &json!({"configOptions": [{"id": "mode", "type": "select", "currentValue": "r",
            "options": [{"value": "r", "name": "Read", "description": "reads"}]}]}),
        );
        assert_eq!(a.modes.len(), 1);
        assert_eq!(
            (a.modes[0].id.as_str(), a.modes[0].description.as_deref()),
            ("r", Some("reads"))
        );
    }

    #[test]
    fn partial_updates_complete_from_earlier_state() {
        let mut tools = ToolTracker::default();
        let (first, _) = tools
            .apply(
                &mut update(json!({"toolCallId": "c1", "title": "ls", "kind": "execute", "status": "in_progress",
                    "rawInput": {"command": "ls"}})),
                true,
            )
            .unwrap();
        assert_eq!(first.tool_kind, ToolKind::Shell);
        assert_eq!(first.status, ToolStatus::Running);
        assert_eq!(first.name, "shell");
        let (second, _) = tools
            .apply(&mut update(json!({"toolCallId": "c1", "status": "completed", "rawOutput": {"stdout": "x"}})), false)
            .unwrap();
        assert_eq!(second.title, "ls");
        assert_eq!(second.tool_kind, ToolKind::Shell);
        assert_eq!(second.input, json!({"command": "ls"}));
        assert_eq!(second.output, Some(json!({"stdout": "x"})));
        assert_eq!(second.status, ToolStatus::Completed);
    }

    #[test]
    fn edit_of_new_files_is_a_write() {
        let mut tools = ToolTracker::default();
        let diff = json!([{"type": "diff", "path": "/w/a", "oldText": null, "newText": "x"}]);
        let (call, _) = tools
            .apply(
                &mut update(
                    json!({"toolCallId": 7, "title": "Write a", "kind": "edit", "content": diff}),
                ),
                true,
            )
            .unwrap();
        assert_eq!(call.call_id, "7");
        assert_eq!(call.tool_kind, ToolKind::Write);
        assert_eq!(
            call.diff,
            [FileDiff {
                path: "/w/a".into(),
                change: ChangeKind::Add,
                move_path: None,
                unified: None,
                old_text: None,
                new_text: Some("x".into()),
            }]
        );
        let (edit, _) = tools
            .apply(
                &mut update(json!({"toolCallId": "e", "kind": "edit",
                    "content": [{"type": "diff", "path": "/w/a", "oldText": "a", "newText": "b"}]})),
                false,
            )
            .unwrap();
        assert_eq!(edit.tool_kind, ToolKind::Edit);
    }

    #[test]
    fn options_get_agentry_ids_by_kind_and_answer_with_the_agents_ids() {
        // Gemini's, codex-acp's and an agent's without kinds.
        let gemini = permission_options(&[
            json!({"optionId": "proceed_always", "name": "Always", "kind": "allow_always"}),
            json!({"optionId": "proceed_once", "name": "Yes", "kind": "allow_once"}),
            json!({"optionId": "cancel", "name": "No", "kind": "reject_once"}),
        ]);
        let shown: Vec<(&str, Behavior)> = gemini
            .iter()
            .map(|(o, _)| (o.id.as_str(), o.behavior))
            .collect();
        assert_eq!(
            shown,
            [
                ("allow_always", Behavior::Allow),
                ("allow", Behavior::Allow),
                ("deny", Behavior::Deny)
            ]
        );
        let answer = |chosen: &str, behavior| provider_option(&gemini, chosen, behavior);
        assert_eq!(
            answer("allow", Behavior::Allow).as_deref(),
            Some("proceed_once")
        );
        assert_eq!(answer("deny", Behavior::Deny).as_deref(), Some("cancel"));
        assert_eq!(
            answer("proceed_always", Behavior::Allow).as_deref(),
            Some("proceed_always")
        );
        assert_eq!(
            answer("nonsense", Behavior::Deny).as_deref(),
            Some("cancel")
        );

        let codex = permission_options(&[
            json!({"optionId": "approved", "name": "Yes", "kind": "allow_once"}),
            json!({"optionId": "approved-for-session", "name": "Yes, this session", "kind": "allow_once"}),
            json!({"optionId": "abort", "name": "No"}),
        ]);
        let ids: Vec<&str> = codex.iter().map(|(o, _)| o.id.as_str()).collect();
        assert_eq!(ids, ["allow", "allow_2", "deny"]);
        assert_eq!(codex[2].0.behavior, Behavior::Deny);
        assert_eq!(
            provider_option(&codex, "allow_2", Behavior::Allow).as_deref(),
            Some("approved-for-session")
        );
    }

    #[tokio::test]
    async fn paths_must_stay_in_the_workspace() {
        use super::super::workspace_files::{relative_to, write};
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        let rel = |p: &Path| relative_to(&root, p);
        assert_eq!(
            rel(&root.join("new/file.txt")).unwrap(),
            Path::new("new/file.txt")
        );
        assert!(rel(Path::new("/etc/passwd")).is_err());
        // The workspace through a symlinked parent.
        let alias_dir = tempfile::tempdir().unwrap();
        let alias = alias_dir.path().join("ws");
        std::os::unix::fs::symlink(&root, &alias).unwrap();
        assert_eq!(
            rel(&alias.join("new/file.txt")).unwrap(),
            Path::new("new/file.txt")
        );
        let escape = rel(&root.join("../escape.txt")).unwrap();
        assert!(write(&root, &escape, b"x".to_vec()).await.is_err());

        // Symlinks that lead out are refused, dangling ones included.
        let outside = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), root.join("out")).unwrap();
        assert!(
            write(&root, Path::new("out/new.txt"), b"x".to_vec())
                .await
                .is_err()
        );
        std::os::unix::fs::symlink(outside.path().join("later.txt"), root.join("dangling"))
            .unwrap();
        assert!(
            write(&root, Path::new("dangling"), b"x".to_vec())
                .await
                .is_err()
        );
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
        // So is git's metadata.
        assert!(
            write(&root, Path::new(".Git/config"), b"x".to_vec())
                .await
                .is_err()
        );
        assert!(!root.join(".Git").exists());
        // A directory symlink that stays inside is fine.
        std::fs::create_dir_all(root.join("real")).unwrap();
        std::os::unix::fs::symlink(root.join("real"), root.join("alias")).unwrap();
        write(&root, Path::new("alias/f.txt"), b"x".to_vec())
            .await
            .unwrap();
        assert!(root.join("real/f.txt").exists());
    }

    #[test]
    fn mcp_servers_become_acp_declarations() {
        let servers = BTreeMap::from([
            (
                "files".to_owned(),
                json!({"command": "mcp-files", "args": ["--root", "."], "env": {"TOKEN": "t"}}),
            ),
            (
                "argv".to_owned(),
                json!({"command": ["npx", "server"], "args": ["-v"]}),
            ),
            (
                "web".to_owned(),
                json!({"type": "http", "url": "https://mcp.example", "headers": {"Authorization": "x"}}),
            ),
            ("broken".to_owned(), json!({"args": []})),
        ]);
        let without_http = mcp_servers(&servers, &proto::McpCapabilities::new());
        let names: Vec<Value> = without_http
            .iter()
            .map(|s| serde_json::to_value(s).unwrap())
            .collect();
        assert_eq!(
            names,
            [
                json!({"name": "argv", "command": "npx", "args": ["server", "-v"], "env": []}),
                json!({"name": "files", "command": "mcp-files", "args": ["--root", "."],
                    "env": [{"name": "TOKEN", "value": "t"}]}),
            ]
        );
        let with_http = mcp_servers(&servers, &proto::McpCapabilities::new().http(true));
        assert_eq!(with_http.len(), 3);
        assert!(
            serde_json::to_value(&with_http[2])
                .unwrap()
                .get("type")
                .is_some_and(|t| t == "http")
        );
    }

    /// What Gemini CLI 0.61.0 sent for an approved `write_file` in `default` mode
    /// (recorded; workspace paths shortened to `/w`), mapped as the adapter maps it.
    #[test]
    fn a_recorded_gemini_write_maps_to_one_call_its_request_and_usage() {
        const WRITE_ALLOW: &str = include_str!("../../tests/fixtures/gemini/write_allow.jsonl");
        let mut tools = ToolTracker::default();
        let mut calls = Vec::new();
        let mut asked = None;
        let mut usage = None;
        for line in WRITE_ALLOW.lines() {
            let mut message: Value = serde_json::from_str(line).unwrap();
            match message["method"].as_str() {
                Some("session/update") => {
                    let update = message["params"]["update"].as_object_mut().unwrap();
                    let tag = update["sessionUpdate"].as_str().unwrap().to_owned();
                    if tag == "tool_call" || tag == "tool_call_update" {
                        let (call, _) = tools.apply(update, tag == "tool_call").unwrap();
                        calls.push(call);
                    }
                }
                Some("session/request_permission") => {
                    let params = &mut message["params"];
                    let offered = permission_options(params["options"].as_array().unwrap());
                    let call = params["toolCall"].as_object_mut().unwrap();
                    // Never announced before: the request creates it.
                    let (call, changed) = tools.apply(call, false).unwrap();
                    assert!(changed);
                    calls.push(call);
                    asked = Some(offered);
                }
                Some(_) => {}
                None if message["result"].get("stopReason").is_some() => {
                    usage = prompt_usage(&message["result"]);
                }
                None => {}
            }
        }
        let [pending, done] = calls.as_slice() else {
            panic!("{calls:?}")
        };
        assert_eq!(pending.call_id, "write_file__write_file_1796125801389_0");
        assert_eq!(pending.status, ToolStatus::Pending);
        assert_eq!(pending.title, "Writing to hello.txt");
        assert_eq!(done.call_id, pending.call_id);
        assert_eq!(done.status, ToolStatus::Completed);
        assert_eq!(done.tool_kind, ToolKind::Write, "a new file is a write");
        assert_eq!(
            done.diff,
            [FileDiff {
                path: "/w/hello.txt".into(),
                change: ChangeKind::Add,
                move_path: None,
                unified: None,
                old_text: None,
                new_text: Some("hello from gemini\n".into()),
            }]
        );
        assert_eq!(done.locations[0].path, "/w/hello.txt");
        let offered = asked.expect("a permission request");
        let ids: Vec<&str> = offered.iter().map(|(o, _)| o.id.as_str()).collect();
        assert_eq!(ids, ["allow_always", "allow", "deny"]);
        assert_eq!(
            provider_option(&offered, "allow", Behavior::Allow).as_deref(),
            Some("proceed_once")
        );
        let usage = usage.expect("usage");
        assert_eq!((usage.input_tokens, usage.output_tokens), (240, 30));
    }

    #[test]
    fn gemini_reports_usage_in_its_quota_meta() {
        // As Gemini CLI 0.61.0 answers `session/prompt`.
        let answer = json!({"stopReason": "end_turn", "_meta": {"quota": {
            "token_count": {"input_tokens": 240, "output_tokens": 30},
            "model_usage": [{"model": "gemini-2.5-flash",
                "token_count": {"input_tokens": 240, "output_tokens": 30}}]}}});
        let usage = prompt_usage(&answer).expect("usage");
        assert_eq!((usage.input_tokens, usage.output_tokens), (240, 30));
        assert_eq!(prompt_usage(&json!({"stopReason": "end_turn"})), None);
    }

    #[test]
    fn prompt_answers_end_turns() {
        let ended = |result, interrupted| match turn_end(result, interrupted) {
            Some(ProviderEvent::TurnEnded { outcome, error, .. }) => Some((outcome, error)),
            _ => None,
        };
        assert_eq!(
            ended(Ok(json!({"stopReason": "end_turn"})), false),
            Some((TurnOutcome::Completed, None))
        );
        assert_eq!(
            ended(Ok(json!({"stopReason": "cancelled"})), true),
            Some((TurnOutcome::Canceled, None))
        );
        assert_eq!(
            ended(Ok(json!({"stopReason": "refusal"})), false),
            Some((TurnOutcome::Failed, Some("the agent refused".to_owned())))
        );
        assert_eq!(
            ended(
                Err(acp::Error::new(acp::ErrorCode::INTERNAL_ERROR, "boom")),
                false
            ),
            Some((TurnOutcome::Failed, Some("boom".to_owned())))
        );
        assert_eq!(
            ended(
                Err(acp::Error::new(acp::ErrorCode::INTERNAL_ERROR, "late")),
                true
            ),
            Some((TurnOutcome::Canceled, None))
        );
    }
}
