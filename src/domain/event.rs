//! The agent event model: one envelope for every timeline row and SSE message, and the
//! closed set of event kinds clients can rely on (see CONTRACT.md).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::ids::{AgentId, TurnId};

/// Every kind of agent event. Stored as text in `agent_events.kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    SessionStarted,
    TurnStarted,
    UserMessage,
    AssistantDelta,
    AssistantMessage,
    ReasoningDelta,
    Reasoning,
    ToolCall,
    PermissionRequested,
    PermissionResolved,
    Plan,
    Usage,
    ModeChanged,
    ModelChanged,
    Status,
    Error,
    TurnCompleted,
    /// The egress proxy refused a connection the agent tried: `host`, `port`, `reason`.
    NetworkDenied,
    /// A prompt waits (its agent runs a turn, or the running-turn limits are reached):
    /// `message_id`, `text`, `client_message_id`?, `interrupt`, `reason`.
    MessageQueued,
    /// A waiting prompt left the queue: `message_id`, `state` (`started` with `turn_id`,
    /// `canceled`, or `failed` with `error`).
    MessageDequeued,
}

impl EventKind {
    pub const ALL: [EventKind; 20] = [
        EventKind::SessionStarted,
        EventKind::TurnStarted,
        EventKind::UserMessage,
        EventKind::AssistantDelta,
        EventKind::AssistantMessage,
        EventKind::ReasoningDelta,
        EventKind::Reasoning,
        EventKind::ToolCall,
        EventKind::PermissionRequested,
        EventKind::PermissionResolved,
        EventKind::Plan,
        EventKind::Usage,
        EventKind::ModeChanged,
        EventKind::ModelChanged,
        EventKind::Status,
        EventKind::Error,
        EventKind::TurnCompleted,
        EventKind::NetworkDenied,
        EventKind::MessageQueued,
        EventKind::MessageDequeued,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::SessionStarted => "session_started",
            EventKind::TurnStarted => "turn_started",
            EventKind::UserMessage => "user_message",
            EventKind::AssistantDelta => "assistant_delta",
            EventKind::AssistantMessage => "assistant_message",
            EventKind::ReasoningDelta => "reasoning_delta",
            EventKind::Reasoning => "reasoning",
            EventKind::ToolCall => "tool_call",
            EventKind::PermissionRequested => "permission_requested",
            EventKind::PermissionResolved => "permission_resolved",
            EventKind::Plan => "plan",
            EventKind::Usage => "usage",
            EventKind::ModeChanged => "mode_changed",
            EventKind::ModelChanged => "model_changed",
            EventKind::Status => "status",
            EventKind::Error => "error",
            EventKind::TurnCompleted => "turn_completed",
            EventKind::NetworkDenied => "network_denied",
            EventKind::MessageQueued => "message_queued",
            EventKind::MessageDequeued => "message_dequeued",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// One durable agent event, exactly as stored and as sent on SSE `data:`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"seq": 7, "agent_id": "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b",
    "turn_id": "trn_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "at": "2026-11-30T12:00:00Z",
    "kind": "assistant_delta", "data": {"message_id": "msg_0193a1b2c3d47e8f9a0b1c2d3e4f5a6d", "text": "Hel"}}))]
pub struct AgentEvent {
    pub seq: i64,
    pub agent_id: AgentId,
    pub turn_id: Option<TurnId>,
    pub at: DateTime<Utc>,
    pub kind: EventKind,
    pub data: Value,
}

/// An event before the writer gives it a sequence number and a time.
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub agent_id: AgentId,
    pub turn_id: Option<TurnId>,
    pub kind: EventKind,
    pub data: Value,
}

/// Lifecycle status of an agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AgentStatus {
    Starting,
    Idle,
    Running,
    WaitingPermission,
    Error,
    Closed,
    /// Not running: its next prompt waits for a running-turn slot (`[limits]`). Only
    /// ever shown, never stored: the agent's own status is underneath.
    Queued,
}

impl AgentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            AgentStatus::Starting => "starting",
            AgentStatus::Idle => "idle",
            AgentStatus::Running => "running",
            AgentStatus::WaitingPermission => "waiting_permission",
            AgentStatus::Error => "error",
            AgentStatus::Closed => "closed",
            AgentStatus::Queued => "queued",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            AgentStatus::Starting,
            AgentStatus::Idle,
            AgentStatus::Running,
            AgentStatus::WaitingPermission,
            AgentStatus::Error,
            AgentStatus::Closed,
            AgentStatus::Queued,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }

    /// A turn is in progress (the agent will not take another prompt).
    pub fn is_busy(self) -> bool {
        matches!(self, AgentStatus::Running | AgentStatus::WaitingPermission)
    }
}

/// How a turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TurnOutcome {
    Completed,
    Failed,
    Canceled,
}

impl TurnOutcome {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            TurnOutcome::Completed => "completed",
            TurnOutcome::Failed => "failed",
            TurnOutcome::Canceled => "canceled",
        }
    }
}

/// What a tool does, normalised across providers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolKind {
    Shell,
    Read,
    Edit,
    Write,
    Search,
    Fetch,
    Mcp,
    Other,
}

/// State of one tool call; each change is one `tool_call` event with the same `call_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolStatus {
    Pending,
    Running,
    Completed,
    Failed,
    Canceled,
}

impl ToolStatus {
    pub fn is_final(self) -> bool {
        matches!(
            self,
            ToolStatus::Completed | ToolStatus::Failed | ToolStatus::Canceled
        )
    }
}

/// What a permission request is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PermissionKind {
    Tool,
    Plan,
    Question,
    Mode,
    Other,
}

/// The two ways a permission can be answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Behavior {
    Allow,
    Deny,
}

impl Behavior {
    pub fn as_str(self) -> &'static str {
        match self {
            Behavior::Allow => "allow",
            Behavior::Deny => "deny",
        }
    }
}

/// One choice offered by a permission request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PermissionOption {
    pub id: String,
    pub label: String,
    pub behavior: Behavior,
}
