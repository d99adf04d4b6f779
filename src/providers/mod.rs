//! Providers translate one agent CLI's protocol into `ProviderEvent`s and carry commands
//! back to it. The trait is shaped for every protocol agentry speaks: ACP (JSON-RPC on
//! stdio), Claude Code's stream-json control protocol, Codex's app-server JSON-RPC,
//! OpenCode's REST + SSE server and Pi's JSONL rpc. What they share:
//! - a session is started (or resumed from a persistence handle) in a workspace, through a
//!   process the runtime records in its ledger before use (`ProcessLauncher`);
//! - a prompt starts a turn and returns at once; the turn's end arrives later as
//!   `ProviderEvent::TurnEnded`;
//! - a permission request carries a one-shot reply channel: the runtime persists it and
//!   answers when a person does (dropping the sender means "cancelled");
//! - the process can die at any time: the adapter reports `ProviderEvent::Exited`.

pub mod acp;
pub mod adapter;
pub mod broker;
pub mod claude;
pub mod codex;
pub mod copilot;
pub mod emitter;
pub mod gemini;
pub mod mcp;
pub mod mock;
pub mod opencode;
pub mod pi;
pub mod registry;
pub mod stdio;
pub mod supervise;
#[cfg(test)]
pub mod test_support;
pub mod workspace_files;

pub use registry::ProviderRegistry;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use utoipa::ToSchema;

use crate::domain::{
    Behavior, PermissionKind, PermissionOption, ToolKind, ToolStatus, TurnOutcome,
};
use crate::process::{CommandSpec, ManagedChild, ProcessError};

/// What a provider is and what it can do; served by `GET /v1/providers`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ProviderInfo {
    pub id: String,
    pub label: String,
    /// `acp`, `claude-stream-json`, `codex-app-server`, `opencode-http`, `pi-rpc`.
    pub protocol: String,
    pub capabilities: ProviderCapabilities,
    pub modes: Vec<ModeInfo>,
    pub default_mode: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct ProviderCapabilities {
    /// A closed session can be reopened with its history.
    pub resume: bool,
    pub set_mode: bool,
    pub set_model: bool,
    pub permissions: bool,
    pub mcp_servers: bool,
}

impl ProviderInfo {
    /// A provider that can do all the trait offers (resume, set mode and model, ask for
    /// permissions, take MCP servers); an adapter that cannot do one of them says so in
    /// `capabilities` afterwards.
    pub fn capable(
        id: &str,
        label: &str,
        protocol: &str,
        modes: Vec<ModeInfo>,
        default_mode: Option<String>,
    ) -> Self {
        Self {
            id: id.to_owned(),
            label: label.to_owned(),
            protocol: protocol.to_owned(),
            capabilities: ProviderCapabilities {
                resume: true,
                set_mode: true,
                set_model: true,
                permissions: true,
                mcp_servers: true,
            },
            modes,
            default_mode,
        }
    }
}

/// Why a provider's command cannot be run, when it cannot: none is configured, or its
/// program is not on PATH (or, named by its path, is not there or not executable).
pub fn command_missing(command: &[String]) -> Option<String> {
    let Some(program) = command.first() else {
        return Some("no command is configured".to_owned());
    };
    if crate::process::find_executable(program).is_some() {
        return None;
    }
    Some(if program.contains('/') {
        format!("`{program}` does not exist or is not executable")
    } else {
        format!("`{program}` was not found on PATH")
    })
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModeInfo {
    pub id: String,
    pub label: String,
    pub description: Option<String>,
    /// The mode runs without asking for approvals.
    pub unattended: bool,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelInfo {
    pub id: String,
    pub label: String,
    pub is_default: bool,
    pub context_window: Option<u64>,
}

/// Whether a provider can be used right now.
#[derive(Debug, Clone)]
pub enum Availability {
    Available,
    Unavailable(String),
}

/// Everything a provider needs to start or resume a session.
#[derive(Debug, Clone)]
pub struct SessionSpec {
    pub cwd: PathBuf,
    pub model: Option<String>,
    pub mode: Option<String>,
    pub system_prompt: Option<String>,
    /// MCP servers by name, in the shape of the create-agent request.
    pub mcp_servers: BTreeMap<String, Value>,
    /// Handle from an earlier session (`SessionInfo::persistence`), to resume it.
    pub resume: Option<Value>,
}

/// Starts provider processes. The runtime implements it so that every process is in its
/// own group and recorded in the `managed_processes` ledger before the adapter uses it.
#[async_trait]
pub trait ProcessLauncher: Send + Sync {
    async fn launch(&self, spec: CommandSpec) -> Result<ManagedChild, ProcessError>;

    /// What it launches runs inside agentry's sandbox, which already confines the process
    /// tree to its worktree: a CLI's own sandbox cannot be nested inside it (it could not
    /// mount a `/proc` of its own) and is not asked for where agentry's holds.
    fn confined(&self) -> bool {
        false
    }

    /// How the server reaches loopback port `port` of a process it launches with
    /// `serves: Some(port)`: `None` when the process shares the server's network (connect
    /// to `127.0.0.1:port`), else the Unix socket on the host that leads to that port in
    /// the process's own network namespace.
    fn reach(&self, _port: u16) -> Option<std::path::PathBuf> {
        None
    }
}

/// Where a catalog is probed: the server-wide default, or one workspace's directory (a
/// CLI may read settings of the project it runs in). The registry keeps one catalog per
/// provider and scope.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CatalogScope {
    Global,
    /// The workspace's directory.
    Workspace(PathBuf),
}

/// What a catalog probe may use: a launcher that records its processes, and a working
/// directory — the workspace for a workspace scope, else an empty directory of its own
/// (removed after the probe).
pub struct Probe {
    pub launcher: Arc<dyn ProcessLauncher>,
    pub cwd: PathBuf,
}

/// Identity of a started session.
#[derive(Debug, Clone)]
pub struct SessionInfo {
    pub provider_session_id: Option<String>,
    /// Opaque JSON the adapter can resume from later (stored in `agents.persistence`).
    pub persistence: Option<Value>,
    pub pid: Option<u32>,
    /// The session resumed an earlier one (rather than starting fresh).
    pub resumed: bool,
    pub current_mode: Option<String>,
    pub current_model: Option<String>,
}

/// A person's answer to a permission request, as handed to the adapter.
#[derive(Debug, Clone)]
pub enum PermissionDecision {
    Selected {
        option_id: String,
        behavior: Behavior,
        message: Option<String>,
        updated_input: Option<Value>,
    },
    /// The turn was canceled or the agent closed before anyone answered.
    Cancelled,
}

/// A permission request raised by the provider.
#[derive(Debug)]
pub struct PermissionRequest {
    /// The provider's own id for the request (JSON-RPC id, `per_…`, …), kept for logs.
    pub provider_request_id: String,
    pub kind: PermissionKind,
    pub title: String,
    pub call_id: Option<String>,
    pub input: Option<Value>,
    pub options: Vec<PermissionOption>,
    pub reply: oneshot::Sender<PermissionDecision>,
}

/// What a person is asked about a provider's permission request: the request without the
/// provider's id for it and the reply channel (see `Emitter::ask`).
#[derive(Debug)]
pub struct Ask {
    pub kind: PermissionKind,
    pub title: String,
    pub call_id: Option<String>,
    pub input: Option<Value>,
    pub options: Vec<PermissionOption>,
}

/// A tool call's state, sent once per status change.
#[derive(Debug, Clone)]
pub struct ToolCallUpdate {
    pub call_id: String,
    pub name: String,
    pub title: String,
    pub tool_kind: ToolKind,
    pub status: ToolStatus,
    pub input: Value,
    pub output: Option<Value>,
    pub error: Option<String>,
    /// The files the call changes (or changed), one entry per file; empty when none.
    pub diff: Vec<FileDiff>,
    /// Files (and lines) the call touches, for "follow the agent" views.
    pub locations: Vec<Location>,
    /// The tool call this one runs inside (a sub-agent's calls), when the CLI says.
    pub parent_call_id: Option<String>,
}

impl ToolCallUpdate {
    /// A call with no output, diff or location yet.
    pub fn new(
        call_id: impl Into<String>,
        name: impl Into<String>,
        tool_kind: ToolKind,
        status: ToolStatus,
        input: Value,
    ) -> Self {
        let name = name.into();
        Self {
            call_id: call_id.into(),
            title: name.clone(),
            name,
            tool_kind,
            status,
            input,
            output: None,
            error: None,
            diff: Vec::new(),
            locations: Vec::new(),
            parent_call_id: None,
        }
    }
}

/// How a file changes, in the one shape every provider reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    Add,
    Modify,
    Delete,
    /// Moved to `move_path` (and maybe modified).
    Rename,
}

/// One file's change: a unified patch when the CLI gives one, else the old and new text
/// (`old_text` absent for a new file, `new_text` absent for a deleted one).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct FileDiff {
    pub path: String,
    pub change: ChangeKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub move_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unified: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub old_text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_text: Option<String>,
}

/// A place a tool call touches.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Location {
    pub path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<u64>,
}

/// Token use. In a `usage` event and in `turn_completed` the counts are the current
/// turn's so far (summed over the model calls the turn made); `context_window_used` is
/// what the conversation occupies after the latest call.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
pub struct Usage {
    /// Input tokens, cached ones included.
    pub input_tokens: u64,
    /// Output tokens, reasoning ones included.
    pub output_tokens: u64,
    /// Input tokens read from the provider's prompt cache.
    pub cached_input_tokens: u64,
    /// Input tokens written to the provider's prompt cache.
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// Output tokens spent on reasoning.
    #[serde(default)]
    pub reasoning_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_window_max: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_window_used: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
}

/// What an adapter reports, in the order it happened.
#[derive(Debug)]
pub enum ProviderEvent {
    /// The provider recorded the turn's prompt under its own message id (for sessions
    /// whose `records_user_messages` is true): the turn's `user_message` carries it.
    UserMessageRecorded {
        message_id: String,
    },
    /// A chunk of assistant text. `message_id` is the provider's, when it has one: a new id
    /// closes the previous message.
    AssistantDelta {
        message_id: Option<String>,
        text: String,
    },
    /// A whole assistant message (for protocols that send text only whole).
    AssistantMessage {
        message_id: Option<String>,
        text: String,
    },
    ReasoningDelta {
        id: Option<String>,
        text: String,
    },
    ToolCall(ToolCallUpdate),
    PermissionRequested(PermissionRequest),
    Plan {
        entries: Vec<PlanEntry>,
    },
    Usage(Usage),
    ModeChanged {
        mode: String,
    },
    ModelChanged {
        model: String,
    },
    /// The current turn ended.
    TurnEnded {
        outcome: TurnOutcome,
        error: Option<String>,
        usage: Option<Usage>,
    },
    /// The provider's session id or persistence handle changed (Claude reports its id
    /// in `system/init`, Pi its session file later). The runtime stores what is `Some`.
    SessionUpdated {
        provider_session_id: Option<String>,
        persistence: Option<Value>,
    },
    /// The CLI withdrew a permission request it raised (it no longer waits for the
    /// answer): the request expires and an answer reaches no one.
    PermissionWithdrawn {
        provider_request_id: String,
    },
    /// Something went wrong that does not end the turn by itself.
    Error {
        message: String,
        code: Option<String>,
    },
    /// The provider process is gone (or the connection to it broke).
    Exited {
        reason: String,
    },
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PlanEntry {
    pub text: String,
    pub status: PlanStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PlanStatus {
    Pending,
    InProgress,
    Completed,
}

impl PlanStatus {
    /// A CLI's status word (`pending`, `in_progress`/`inProgress`, `completed`/`done`);
    /// anything else reads as pending.
    pub fn parse(word: &str) -> Self {
        match word {
            "in_progress" | "inProgress" | "running" | "active" => Self::InProgress,
            "completed" | "done" | "complete" => Self::Completed,
            _ => Self::Pending,
        }
    }
}

/// Where an adapter sends its events.
pub type EventSink = mpsc::Sender<ProviderEvent>;

/// One prompt, as handed to an adapter.
#[derive(Debug, Clone)]
pub struct TurnInput {
    pub text: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error("provider unavailable: {0}")]
    Unavailable(String),
    #[error("failed to start the provider process: {0}")]
    Spawn(#[from] ProcessError),
    #[error("provider protocol error: {0}")]
    Protocol(String),
    #[error("the provider does not support {0}")]
    Unsupported(&'static str),
    #[error("the provider process is gone")]
    Gone,
}

/// What starts a session's processes: the runtime's launcher, which records each in its
/// ledger before the adapter uses it.
pub type Launcher = Arc<dyn ProcessLauncher>;

/// What `Provider::start` answers: the live session and what is known of it.
pub type Started = Result<(Box<dyn ProviderSession>, SessionInfo), ProviderError>;

/// A provider: knows how to check itself and start sessions.
#[async_trait]
pub trait Provider: Send + Sync {
    fn info(&self) -> ProviderInfo;
    /// Cheap check that the CLI is installed (and signed in, where that can be told).
    async fn availability(&self) -> Availability;
    /// Probe the provider for its models (for a static list, read the list again). A
    /// probe that runs the CLI starts it through `probe.launcher` (so it is in the ledger)
    /// in `probe.cwd`, and leaves no process or session behind. The registry caches the
    /// answer; see `ProviderRegistry::models`.
    async fn models(&self, _probe: &Probe) -> Result<Vec<ModelInfo>, ProviderError> {
        Ok(Vec::new())
    }
    /// Start (or resume, when `spec.resume` is set) a session. Events flow into `events`
    /// until the session ends; `ProviderEvent::Exited` is the last one.
    async fn start(&self, spec: SessionSpec, launcher: Launcher, events: EventSink) -> Started;
}

/// A live session. Methods return once the command is handed to the provider; their
/// effects arrive as events.
#[async_trait]
pub trait ProviderSession: Send + Sync {
    async fn prompt(&mut self, input: TurnInput) -> Result<(), ProviderError>;
    /// Ask the provider to stop the current turn; it ends with `TurnEnded { Canceled }`.
    async fn interrupt(&mut self) -> Result<(), ProviderError>;
    async fn set_mode(&mut self, _mode: &str) -> Result<(), ProviderError> {
        Err(ProviderError::Unsupported("changing the mode"))
    }
    async fn set_model(&mut self, _model: &str) -> Result<(), ProviderError> {
        Err(ProviderError::Unsupported("changing the model"))
    }
    /// Stop the session and its process group (TERM, grace, KILL).
    async fn close(self: Box<Self>);
    /// The provider names each prompt's message itself and says so with
    /// `ProviderEvent::UserMessageRecorded`; the runtime then records the turn's
    /// `user_message` under that id (or under its own, should the turn end first).
    fn records_user_messages(&self) -> bool {
        false
    }
}

/// A provider's settings once its built-in defaults and its `[providers.<id>]` table are
/// merged: what an adapter needs to run its CLI.
#[derive(Debug, Clone)]
pub struct CliConfig {
    pub id: String,
    pub label: String,
    /// The program and any arguments of the `command` setting; the adapter adds its
    /// protocol flags after them.
    pub command: Vec<String>,
    /// The `args` setting, passed after the adapter's own flags.
    pub args: Vec<String>,
    /// Extra environment (the `env` setting over the built-in defaults).
    pub env: BTreeMap<String, String>,
    /// Credential variables passed on from the server's environment when set there.
    pub pass_env: Vec<String>,
    /// Variables each team supplies as a team secret (the `team_secrets` setting). The
    /// values reach the child through its launcher; whether a team has set them is the
    /// caller's to check, so for `availability` they count as set.
    pub team_secrets: Vec<String>,
    pub modes: Vec<ModeInfo>,
    pub default_mode: Option<String>,
    /// Where the adapter may keep files of its own across restarts
    /// (`<data_dir>/providers/<id>`); `None` when the registry was built without a data
    /// directory (then an adapter that needs one uses a temporary directory).
    pub state_dir: Option<PathBuf>,
}

impl CliConfig {
    /// The value a variable will have in the child: the configured `env`, else the
    /// server's own environment when the variable is one the provider passes on.
    pub fn child_var(&self, name: &str) -> Option<String> {
        if let Some(v) = self.env.get(name) {
            return Some(v.clone());
        }
        if self.pass_env.iter().any(|p| p == name) || crate::process::BASE_ENV.contains(&name) {
            return std::env::var(name).ok();
        }
        None
    }

    /// The variable will have a non-empty value in the child: from `env` or the server's
    /// environment (see `child_var`), or as a team secret.
    pub fn var_is_set(&self, name: &str) -> bool {
        self.team_secrets.iter().any(|t| t == name)
            || self.child_var(name).is_some_and(|v| !v.is_empty())
    }

    /// What `Provider::info` says of a built-in adapter that speaks `protocol` and can do
    /// all the trait offers.
    pub fn info(&self, protocol: &str) -> ProviderInfo {
        ProviderInfo::capable(
            &self.id,
            &self.label,
            protocol,
            self.modes.clone(),
            self.default_mode.clone(),
        )
    }

    /// The command that runs the CLI in `cwd`: its argv (see `argv`), with the settings'
    /// `env` for the child's environment (to which the adapter may add) and the
    /// credential variables it passes on.
    pub fn command(&self, protocol: &[String], cwd: PathBuf) -> Result<CommandSpec, ProviderError> {
        let argv = self.argv(protocol);
        let Some((program, args)) = argv.split_first() else {
            return Err(ProviderError::Unavailable(
                "no command is configured".to_owned(),
            ));
        };
        Ok(CommandSpec {
            env: self.env.clone(),
            pass_env: self.pass_env.clone(),
            ..CommandSpec::new(program.clone(), args.to_vec(), cwd)
        })
    }

    /// The mode a session starts in: the one asked for, else the configured default,
    /// else the adapter's `fallback`.
    pub fn mode_or_default(&self, requested: Option<&str>, fallback: &str) -> String {
        requested
            .map(str::to_owned)
            .or_else(|| self.default_mode.clone())
            .unwrap_or_else(|| fallback.to_owned())
    }

    /// The child's argv: `command`, then the adapter's `protocol` flags, then `args`.
    pub fn argv(&self, protocol: &[String]) -> Vec<String> {
        let mut argv = self.command.clone();
        argv.extend(protocol.iter().cloned());
        argv.extend(self.args.iter().cloned());
        argv
    }
}

/// A provider agentry knows by id, with its defaults; `[providers.<id>]` adjusts it and
/// `extends = "<id>"` makes more profiles of it.
pub struct Builtin {
    pub id: &'static str,
    pub label: &'static str,
    /// The program run by default (looked up on PATH).
    pub program: &'static str,
    /// Credential and configuration variables passed on from the server's environment.
    pub pass_env: &'static [&'static str],
    /// Environment every child of the provider gets unless the settings' `env` says
    /// otherwise (a server's CLIs neither update themselves nor phone home).
    pub env: &'static [(&'static str, &'static str)],
    /// Whether its model API key can stay outside the sandbox, and how (see `broker`).
    pub credential: broker::Credential,
    pub modes: &'static [ModeRow],
    pub default_mode: &'static str,
    pub build: fn(CliConfig) -> Arc<dyn Provider>,
}

/// A mode as a built-in descriptor lists it: id, label, description, and whether it runs
/// without asking for approvals.
pub type ModeRow = (&'static str, &'static str, &'static str, bool);

/// The modes of a built-in descriptor's table.
pub fn modes_of(rows: &[ModeRow]) -> Vec<ModeInfo> {
    rows.iter()
        .map(|&(id, label, description, unattended)| mode(id, label, description, unattended))
        .collect()
}

/// A mode as the built-in descriptors list them.
pub fn mode(id: &str, label: &str, description: &str, unattended: bool) -> ModeInfo {
    ModeInfo {
        id: id.to_owned(),
        label: label.to_owned(),
        description: Some(description.to_owned()),
        unattended,
    }
}
