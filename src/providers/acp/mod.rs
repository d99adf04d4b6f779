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

use super::emitter::{Emitter, StopSignals, Stopper};
use super::{
    Ask, Availability, ChangeKind, CliConfig, EventSink, FileDiff, Launcher, Location, ModeInfo,
    ModelInfo, PermissionDecision, PlanEntry, PlanStatus, Provider, ProviderError, ProviderEvent,
    ProviderInfo, ProviderSession, SessionInfo, SessionSpec, Started, ToolCallUpdate, TurnInput,
    Usage, command_missing,
};
use crate::domain::{
    Behavior, PermissionKind, PermissionOption, ToolKind, ToolStatus, TurnOutcome,
};
use crate::process::output::{StderrReader, StderrTail};
use crate::process::{CommandSpec, ManagedChild, lock};

mod files;
mod gate;
mod handshake;
mod inbound;
mod mapping;
mod presets;
mod session;
mod tools;

use self::files::{read_text_file, write_text_file};
use self::handshake::{change_mode, change_model, request_error, set_model_request, start_session};
use self::inbound::InboundHandler;
use self::mapping::{
    UpdateTag, acp_diff, announced_models, announced_modes, content_text, id_string,
    permission_options, permission_outcome, provider_option, take_string, take_text_chunk,
    tool_kind_name, tool_status, turn_end,
};
use self::session::AcpSession;
use self::tools::ToolTracker;
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
        // The settings' modes; else those the agent announced.
        let modes = if self.cfg.modes.is_empty() {
            lock(&self.announced).modes.clone()
        } else {
            self.cfg.modes.clone()
        };
        let mut info = ProviderInfo::capable(
            &self.cfg.id,
            &self.cfg.label,
            "acp",
            modes,
            self.cfg.default_mode.clone(),
        );
        info.capabilities.mcp_servers = self.takes_mcp;
        info
    }

    async fn availability(&self) -> Availability {
        match command_missing(&self.cfg.command) {
            None => Availability::Available,
            Some(why) => Availability::Unavailable(why),
        }
    }

    async fn start(&self, spec: SessionSpec, launcher: Launcher, events: EventSink) -> Started {
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
    stderr: StderrTail,
    /// Credits of the gate on the agent's stdout: one per update being handled.
    update_credits: Arc<UpdateCredits>,
}

impl Shared {
    /// Report a mode or model change, unless the session is still being set up.
    async fn report_change(&self, event: ProviderEvent) {
        if !self.starting.load(Ordering::Acquire) {
            self.events.emit(event).await;
        }
    }

    /// The model the agent's config options now name, when they changed it.
    async fn report_model(&self, model: Option<String>) {
        if let Some(model) = model {
            self.report_change(ProviderEvent::ModelChanged { model })
                .await;
        }
    }

    /// `value` is now the current mode or model, set at agentry's request: report it,
    /// unless the agent reported it itself since its reports numbered `before`.
    async fn report_if_new(&self, setting: Setting, before: u64, value: &str) {
        let new = {
            let mut guard = lock(&self.config);
            let config = &mut *guard;
            let (current, reports) = match setting {
                Setting::Mode => (&mut config.current_mode, config.mode_reports),
                Setting::Model => (&mut config.current_model, config.model_reports),
            };
            let already = reports != before && current.as_deref() == Some(value);
            *current = Some(value.to_owned());
            !already
        };
        if new {
            let value = value.to_owned();
            self.report_change(match setting {
                Setting::Mode => ProviderEvent::ModeChanged { mode: value },
                Setting::Model => ProviderEvent::ModelChanged { model: value },
            })
            .await;
        }
    }
}

/// What agentry asked the agent to change.
#[derive(Clone, Copy)]
enum Setting {
    Mode,
    Model,
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

#[cfg(test)]
mod tests;
