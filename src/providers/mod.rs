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
pub mod mock;
pub mod registry;

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
    pub diff: Option<Value>,
}

#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_input_tokens: u64,
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
    pub status: String,
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

/// A provider: knows how to check itself and start sessions.
#[async_trait]
pub trait Provider: Send + Sync {
    fn info(&self) -> ProviderInfo;
    /// Cheap check that the CLI is installed (and signed in, where that can be told).
    async fn availability(&self) -> Availability;
    /// Probe the provider for its models (for a static list, read the list again). The
    /// registry caches the answer; see `ProviderRegistry::models`.
    async fn models(&self) -> Result<Vec<ModelInfo>, ProviderError> {
        Ok(Vec::new())
    }
    /// Start (or resume, when `spec.resume` is set) a session. Events flow into `events`
    /// until the session ends; `ProviderEvent::Exited` is the last one.
    async fn start(
        &self,
        spec: SessionSpec,
        launcher: Arc<dyn ProcessLauncher>,
        events: EventSink,
    ) -> Result<(Box<dyn ProviderSession>, SessionInfo), ProviderError>;
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
}
