//! Claude Code, driven directly over its stream-json control protocol: NDJSON user
//! messages and control requests on stdin, the CLI's messages on stdout (mapped in
//! `mapping`). One process per session; the session id is chosen here (`--session-id`)
//! and reopened with `--resume`.
//!
//! Ordering: one task reads stdout and hands each message's events to the sink before it
//! reads the next, so `TurnEnded` follows everything the turn produced. The same task
//! owns the process: when stdout ends or the process exits it reaps it and sends
//! `Exited` last.

pub mod mapping;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};

use self::mapping::{Action, Mapper, ToolPermission};
use super::adapter::*;
use super::broker::{BrokerSpec, Credential, KeyHeader, KeyVar};
use super::stdio::{Cli, Io, JsonLines, Pending, Session};
use crate::domain::{Behavior, PermissionOption};
use crate::process::line_writer::LineWriter;
use crate::process::output::{StderrTail, describe_exit};
use crate::process::{CommandSpec, ManagedChild, lock};

/// How long the CLI may take to answer `initialize`.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a mode or model change may take to be confirmed.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(15);

const PROTOCOL: &str = "claude-stream-json";

static CLI: Cli = Cli {
    name: "Claude Code",
    agent: "claude",
    stderr_log: "agentry::providers::claude::stderr",
    drain: Duration::from_millis(500),
    // Time to finish writing its transcript.
    after_eof: Duration::from_secs(3),
};

/// The built-in descriptor of `claude`.
pub fn builtin() -> Builtin {
    Builtin {
        id: "claude",
        label: "Claude Code",
        program: "claude",
        pass_env: &[
            "ANTHROPIC_API_KEY",
            "ANTHROPIC_AUTH_TOKEN",
            "ANTHROPIC_BASE_URL",
            "ANTHROPIC_MODEL",
            "CLAUDE_CONFIG_DIR",
            "CLAUDE_CODE_USE_BEDROCK",
            "CLAUDE_CODE_USE_VERTEX",
            "AWS_PROFILE",
            "AWS_REGION",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "CLOUD_ML_REGION",
            "ANTHROPIC_VERTEX_PROJECT_ID",
        ],
        // The only connection the CLI then makes is to the model API: no telemetry, no
        // error reports, no self-update of a pinned CLI.
        env: &[("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")],
        credential: Credential::Brokerable(BrokerSpec {
            prefix: "anthropic",
            base_url_var: "ANTHROPIC_BASE_URL",
            default_upstream: Some("https://api.anthropic.com"),
            keys: &[
                KeyVar {
                    var: "ANTHROPIC_API_KEY",
                    header: KeyHeader::Named("x-api-key"),
                },
                KeyVar {
                    var: "ANTHROPIC_AUTH_TOKEN",
                    header: KeyHeader::Bearer,
                },
            ],
            not_with: &[
                (
                    "CLAUDE_CODE_USE_BEDROCK",
                    "Bedrock signs each request with the AWS credentials, inside",
                ),
                (
                    "CLAUDE_CODE_USE_VERTEX",
                    "Vertex AI uses the Google Cloud credentials, inside",
                ),
            ],
            only_when: None,
        }),
        modes: MODES,
        default_mode: "default",
        build: |cfg| Arc::new(ClaudeProvider::new(cfg)),
    }
}

#[rustfmt::skip]
const MODES: &[ModeRow] = &[
    ("default", "Ask", "Asks before running commands and editing files", false),
    ("acceptEdits", "Accept edits", "Edits files without asking; asks before other commands", false),
    ("plan", "Plan", "Reads and plans only; changes nothing", false),
    ("bypassPermissions", "Bypass permissions", "Runs every tool without asking", true),
];

/// Claude Code as a provider.
pub struct ClaudeProvider {
    cfg: CliConfig,
    /// How long the CLI may take to answer `initialize` (`START_TIMEOUT`).
    start_timeout: Duration,
}

impl ClaudeProvider {
    pub fn new(cfg: CliConfig) -> Self {
        Self {
            cfg,
            start_timeout: START_TIMEOUT,
        }
    }

    /// The command and the child's environment, with the protocol flags in `flags`.
    fn command(&self, flags: &[String], cwd: PathBuf) -> Result<CommandSpec, ProviderError> {
        let mut command = self.cfg.command(flags, cwd)?;
        // As root the CLI refuses `bypassPermissions` unless told it runs in a sandbox;
        // a session may switch to that mode later, so it is always set for root.
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            command
                .env
                .entry("IS_SANDBOX".to_owned())
                .or_insert_with(|| "1".to_owned());
        }
        Ok(command)
    }

    /// Where a signed-in CLI keeps its credentials.
    fn credential_files(&self) -> Vec<PathBuf> {
        let mut files = Vec::new();
        if let Some(dir) = self.cfg.child_var("CLAUDE_CONFIG_DIR") {
            files.push(PathBuf::from(&dir).join(".credentials.json"));
            files.push(PathBuf::from(dir).join(".claude/.credentials.json"));
        }
        if let Some(home) = self.cfg.child_var("HOME") {
            files.push(PathBuf::from(home).join(".claude/.credentials.json"));
        }
        files
    }
}

const STREAM_FLAGS: [&str; 8] = [
    "--output-format",
    "stream-json",
    "--input-format",
    "stream-json",
    "--verbose",
    "--include-partial-messages",
    "--permission-prompt-tool",
    "stdio",
];

/// The protocol flags of a session.
fn session_flags(spec: &SessionSpec, session_id: &str, resume: bool) -> Vec<String> {
    let mut flags: Vec<String> = STREAM_FLAGS.iter().map(|f| (*f).to_owned()).collect();
    if resume {
        flags.push(format!("--resume={session_id}"));
    } else {
        flags.push(format!("--session-id={session_id}"));
    }
    if let Some(model) = &spec.model {
        flags.push("--model".to_owned());
        flags.push(model.clone());
    }
    if let Some(mode) = &spec.mode {
        flags.push("--permission-mode".to_owned());
        flags.push(mode.clone());
    }
    if let Some(prompt) = &spec.system_prompt {
        flags.push("--append-system-prompt".to_owned());
        flags.push(prompt.clone());
    }
    if !session_files(spec).is_empty() {
        // A file, not the JSON itself: its headers carry tokens (agentry's own server's
        // among them), and a command line is readable by every local user.
        flags.push("--mcp-config".to_owned());
        flags.push(crate::process::private_file_arg(MCP_CONFIG_FILE));
        flags.push("--strict-mcp-config".to_owned());
    }
    flags
}

/// The name of the session's MCP configuration among its process's private files.
const MCP_CONFIG_FILE: &str = "mcp-config.json";

/// The private files of a session's process: its MCP configuration, when it has servers.
fn session_files(spec: &SessionSpec) -> Vec<(String, crate::domain::SecretValue)> {
    mcp_config(&spec.mcp_servers)
        .map(|config| {
            vec![(
                MCP_CONFIG_FILE.to_owned(),
                crate::domain::SecretValue::new(config.to_string()),
            )]
        })
        .unwrap_or_default()
}

/// The agent's MCP servers as an inline `--mcp-config` (`{"mcpServers":{…}}`): stdio
/// servers (`command` as a string or an argv list, `args`, `env`) and `http`/`sse` ones
/// (`url`, `headers`). `None` when there are none.
fn mcp_config(servers: &std::collections::BTreeMap<String, Value>) -> Option<Value> {
    let mut out = serde_json::Map::new();
    for (name, server) in servers {
        let kind = server.get("type").and_then(Value::as_str);
        let entry = match kind {
            Some(t @ ("http" | "sse")) => {
                let Some(url) = server.get("url").and_then(Value::as_str) else {
                    continue;
                };
                let mut e = json!({"type": t, "url": url});
                if let Some(h) = server.get("headers").filter(|h| h.is_object()) {
                    e["headers"] = h.clone();
                }
                e
            }
            _ => {
                let (command, mut args): (String, Vec<Value>) = match server.get("command") {
                    Some(Value::String(c)) => (c.clone(), Vec::new()),
                    Some(Value::Array(argv)) => match argv.split_first() {
                        Some((Value::String(c), rest)) => (c.clone(), rest.to_vec()),
                        _ => continue,
                    },
                    _ => continue,
                };
                if let Some(more) = server.get("args").and_then(Value::as_array) {
                    args.extend(more.iter().cloned());
                }
                let mut e = json!({"type": "stdio", "command": command, "args": args});
                if let Some(env) = server.get("env").filter(|e| e.is_object()) {
                    e["env"] = env.clone();
                }
                e
            }
        };
        out.insert(name.clone(), entry);
    }
    (!out.is_empty()).then(|| json!({ "mcpServers": out }))
}

#[async_trait]
impl Provider for ClaudeProvider {
    fn info(&self) -> ProviderInfo {
        self.cfg.info(PROTOCOL)
    }

    async fn availability(&self) -> Availability {
        if let Some(why) = command_missing(&self.cfg.command) {
            return Availability::Unavailable(why);
        }
        let set = |name: &str| self.cfg.var_is_set(name);
        if set("ANTHROPIC_API_KEY")
            || set("ANTHROPIC_AUTH_TOKEN")
            || set("CLAUDE_CODE_USE_BEDROCK")
            || set("CLAUDE_CODE_USE_VERTEX")
        {
            return Availability::Available;
        }
        let files = self.credential_files();
        if files.iter().any(|f| f.is_file()) {
            return Availability::Available;
        }
        let looked: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        Availability::Unavailable(format!(
            "no Claude credentials: set ANTHROPIC_API_KEY or ANTHROPIC_AUTH_TOKEN (in the \
             server's environment or the provider's `env`), or sign in with `claude` so that \
             a credentials file exists (looked for {})",
            if looked.is_empty() {
                "none: HOME is not set".to_owned()
            } else {
                looked.join(", ")
            }
        ))
    }

    async fn models(&self, probe: &Probe) -> Result<Vec<ModelInfo>, ProviderError> {
        let flags: Vec<String> = STREAM_FLAGS.iter().map(|f| (*f).to_owned()).collect();
        let spec = self.command(&flags, probe.cwd.clone())?;
        let mut child = probe.launcher.launch(spec).await?;
        let answer = probe_initialize(&mut child).await;
        // Closing stdin ends the CLI; whatever is left is stopped.
        drop(child.take_stdin());
        child.wind_down(None, CLI.after_eof).await;
        let response = answer?;
        Ok(models_of(&response))
    }

    async fn start(&self, spec: SessionSpec, launcher: Launcher, events: EventSink) -> Started {
        let resume_id = spec
            .resume
            .as_ref()
            .and_then(|h| h.get("session_id"))
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty())
            .map(str::to_owned);
        let resumed = resume_id.is_some();
        let session_id = resume_id.unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
        let flags = session_flags(&spec, &session_id, resumed);
        let mut command = self.command(&flags, spec.cwd.clone())?;
        command.private_files = session_files(&spec);
        let attempt = start_session(
            command,
            session_id.clone(),
            resumed,
            &spec,
            launcher.clone(),
            events.clone(),
            self.start_timeout,
        )
        .await;
        let failure = match attempt {
            Err(StartFailure::Ended(why)) if resumed => why,
            Ok((session, info)) => return Ok((session, info)),
            Err(other) => return Err(other.into_error()),
        };
        // The CLI could not reopen the conversation (it keeps none for a session that
        // never got a prompt, or its transcript is gone): start afresh under the same id,
        // and say so.
        tracing::warn!(session = %session_id, reason = %failure, "could not resume; starting a new session");
        let flags = session_flags(&spec, &session_id, false);
        let mut command = self.command(&flags, spec.cwd.clone())?;
        command.private_files = session_files(&spec);
        let (session, info) = start_session(
            command,
            session_id,
            false,
            &spec,
            launcher,
            events,
            self.start_timeout,
        )
        .await
        .map_err(StartFailure::into_error)?;
        let _ = session
            .shared
            .io
            .events
            .emit(ProviderEvent::Error {
                message: format!(
                    "the earlier conversation could not be reopened ({failure}); a new session was started"
                ),
                code: Some("resume_failed".to_owned()),
            })
            .await;
        Ok((session, info))
    }
}

/// Send `initialize` to a probe process and return the inner response.
async fn probe_initialize(child: &mut ManagedChild) -> Result<Value, ProviderError> {
    let (Some(stdin), Some(stdout)) = (child.take_stdin(), child.take_stdout()) else {
        return Err(ProviderError::Protocol(
            "the CLI has no piped stdio".to_owned(),
        ));
    };
    let redactor = child.redactor();
    let stderr = child
        .take_stderr()
        .map(|e| StderrTail::capture_masked(e, "agentry::providers::claude::stderr", redactor));
    let writer = LineWriter::new(stdin);
    let id = "agentry_probe";
    writer
        .send(&json!({"type": "control_request", "request_id": id,
            "request": {"subtype": "initialize", "hooks": null}}))
        .await
        .map_err(|_| ProviderError::Gone)?;
    let mut lines = JsonLines::new(stdout, CLI.name);
    let read = async {
        while let Some(message) = lines.next_message().await {
            if let Some(Action::ControlResponse { request_id, result }) =
                mapping::Mapper::new("").map(&message).pop()
                && request_id == id
            {
                return result.map_err(ProviderError::Protocol);
            }
        }
        Err(ProviderError::Gone)
    };
    let result = match tokio::time::timeout(START_TIMEOUT, read).await {
        Ok(result) => result,
        Err(_) => Err(ProviderError::Protocol(format!(
            "the CLI did not answer `initialize` within {} s",
            START_TIMEOUT.as_secs()
        ))),
    };
    writer.close().await;
    match (result, stderr) {
        (Err(ProviderError::Gone), Some((tail, reader))) => {
            reader.settle().await;
            Err(ProviderError::Protocol(describe_exit(
                None,
                Some("the CLI stopped before answering `initialize`"),
                &tail.tail(),
            )))
        }
        (result, _) => result,
    }
}

/// The models of an `initialize` response.
fn models_of(response: &Value) -> Vec<ModelInfo> {
    response
        .get("models")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let id = m
                .get("value")
                .or_else(|| m.get("id"))
                .and_then(Value::as_str)?;
            let label = m
                .get("displayName")
                .or_else(|| m.get("label"))
                .and_then(Value::as_str)
                .unwrap_or(id);
            Some(ModelInfo {
                id: id.to_owned(),
                label: label.to_owned(),
                is_default: m.get("isDefault").and_then(Value::as_bool) == Some(true)
                    || id == "default",
                context_window: m
                    .get("contextWindow")
                    .or_else(|| m.get("context_window"))
                    .and_then(Value::as_u64),
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Session state shared by the reader, the session handle and permission answers
// ---------------------------------------------------------------------------------------

struct Shared {
    io: Io,
    session_id: Mutex<String>,
    /// Our control requests waiting for their response.
    controls: Pending,
    /// `can_use_tool` requests not answered yet, with the tool's input. Whoever removes
    /// an entry (the person's answer, an interrupt, the CLI's withdrawal) answers it.
    permissions: Mutex<HashMap<String, Value>>,
    /// The permission mode the CLI is in, as far as it has said.
    mode: Mutex<Option<String>>,
}

impl Shared {
    /// Send a control request and wait (at most `timeout`) for its response.
    async fn control(&self, request: Value, timeout: Duration) -> Result<Value, ProviderError> {
        let id = self.controls.next_id();
        let subtype = request
            .get("subtype")
            .and_then(Value::as_str)
            .unwrap_or("control")
            .to_owned();
        let message = json!({"type": "control_request", "request_id": id, "request": request});
        self.controls
            .ask(&self.io.writer, id, &subtype, &message, timeout)
            .await
    }

    /// Answer `can_use_tool` request `request_id`, unless someone already did.
    async fn answer_permission(&self, request_id: &str, decision: PermissionDecision) {
        let Some(input) = lock(&self.permissions).remove(request_id) else {
            return;
        };
        let response = permission_response(decision, input);
        let message = json!({"type": "control_response", "response": {
            "subtype": "success", "request_id": request_id, "response": response}});
        if self.io.writer.send(&message).await.is_err() {
            tracing::debug!("the CLI is gone; a permission answer was not delivered");
        }
    }
}

impl Session for Shared {
    type Mapper = Mapper;

    fn io(&self) -> &Io {
        &self.io
    }

    fn forget(&self) {
        self.controls.clear();
        lock(&self.permissions).clear();
    }

    /// Handle one stdout message.
    async fn handle(self: &Arc<Self>, mapper: &mut Mapper, message: &Value) {
        for action in mapper.map(message) {
            match action {
                Action::Event(event) => {
                    if let ProviderEvent::SessionUpdated {
                        provider_session_id: Some(id),
                        ..
                    } = &event
                    {
                        *lock(&self.session_id) = id.clone();
                    }
                    self.io.events.emit(event).await;
                }
                Action::Permission(request) => self.raise_permission(request).await,
                Action::ControlResponse { request_id, result } => {
                    if self.controls.answer(&request_id, result).is_err() {
                        tracing::trace!(%request_id, "a control response nobody waits for");
                    }
                }
                Action::Withdrawn { request_id } => {
                    if lock(&self.permissions).remove(&request_id).is_some() {
                        self.io
                            .events
                            .emit(ProviderEvent::PermissionWithdrawn {
                                provider_request_id: request_id,
                            })
                            .await;
                    }
                }
                Action::Unsupported {
                    request_id,
                    subtype,
                } => {
                    tracing::debug!(%subtype, "refusing a control request agentry does not serve");
                    let _ = self
                        .io
                        .writer
                        .send(&json!({"type": "control_response", "response": {
                            "subtype": "error", "request_id": request_id,
                            "error": format!("`{subtype}` is not supported by this client")}}))
                        .await;
                }
                Action::ModeReported(mode) => {
                    let changed = {
                        let mut current = lock(&self.mode);
                        let changed = current.as_deref() != Some(mode.as_str());
                        *current = Some(mode.clone());
                        changed
                    };
                    if changed {
                        self.io
                            .events
                            .emit(ProviderEvent::ModeChanged { mode })
                            .await;
                    }
                }
            }
        }
    }
}

impl Shared {
    async fn raise_permission(self: &Arc<Self>, request: ToolPermission) {
        let ToolPermission {
            request_id,
            tool_name: _,
            call_id,
            input,
            title,
            kind,
            suggestions,
        } = request;
        let mut options = vec![PermissionOption {
            id: "allow".to_owned(),
            label: "Allow".to_owned(),
            behavior: Behavior::Allow,
        }];
        if suggestions.is_some() {
            options.push(PermissionOption {
                id: "allow_always".to_owned(),
                label: "Always allow".to_owned(),
                behavior: Behavior::Allow,
            });
        }
        options.push(PermissionOption {
            id: "deny".to_owned(),
            label: "Deny".to_owned(),
            behavior: Behavior::Deny,
        });
        let stored = json!({"input": input, "suggestions": suggestions});
        lock(&self.permissions).insert(request_id.clone(), stored);
        let ask = Ask {
            kind,
            title,
            call_id,
            input: Some(input),
            options,
        };
        let answer = self.io.events.ask(request_id.clone(), ask).await;
        let shared = self.clone();
        tokio::spawn(async move {
            let decision = answer.await.unwrap_or(PermissionDecision::Cancelled);
            shared.answer_permission(&request_id, decision).await;
        });
    }
}

/// The `can_use_tool` answer for a decision; `stored` holds the request's input and
/// suggestions.
fn permission_response(decision: PermissionDecision, stored: Value) -> Value {
    match decision {
        PermissionDecision::Selected {
            option_id,
            behavior: Behavior::Allow,
            updated_input,
            ..
        } => {
            let input = updated_input.unwrap_or_else(|| stored["input"].clone());
            let mut response = json!({"behavior": "allow", "updatedInput": input});
            if option_id == "allow_always"
                && let Some(suggestions) = stored.get("suggestions").filter(|s| !s.is_null())
            {
                response["updatedPermissions"] = suggestions.clone();
            }
            response
        }
        PermissionDecision::Selected {
            behavior: Behavior::Deny,
            message,
            ..
        } => json!({"behavior": "deny",
            "message": message.unwrap_or_else(|| "The user denied this tool call.".to_owned())}),
        PermissionDecision::Cancelled => json!({"behavior": "deny",
            "message": "The user interrupted the turn.", "interrupt": true}),
    }
}

// ---------------------------------------------------------------------------------------
// Starting, reading, supervising
// ---------------------------------------------------------------------------------------

/// Why a session did not start.
enum StartFailure {
    /// The process ended before it answered `initialize` (the reason quotes its stderr).
    Ended(String),
    Other(ProviderError),
}

impl StartFailure {
    fn into_error(self) -> ProviderError {
        match self {
            StartFailure::Ended(why) => ProviderError::Protocol(why),
            StartFailure::Other(e) => e,
        }
    }
}

impl From<ProviderError> for StartFailure {
    fn from(e: ProviderError) -> Self {
        StartFailure::Other(e)
    }
}

impl From<crate::process::ProcessError> for StartFailure {
    fn from(e: crate::process::ProcessError) -> Self {
        StartFailure::Other(e.into())
    }
}

async fn start_session(
    command: CommandSpec,
    session_id: String,
    resumed: bool,
    spec: &SessionSpec,
    launcher: Launcher,
    events: EventSink,
    start_timeout: Duration,
) -> Result<(Box<ClaudeSession>, SessionInfo), StartFailure> {
    let (io, process) = CLI.launch(launcher.as_ref(), command, events).await?;
    let pid = process.pid();
    let shared = Arc::new(Shared {
        io,
        session_id: Mutex::new(session_id.clone()),
        controls: Pending::default(),
        permissions: Mutex::new(HashMap::new()),
        mode: Mutex::new(spec.mode.clone()),
    });

    let (mut stopper, signals) = Stopper::new();
    tokio::spawn(CLI.supervise(
        process,
        shared.clone(),
        if resumed {
            Mapper::new(session_id.clone())
        } else {
            Mapper::new(session_id.clone()).announcing()
        },
        signals,
    ));

    let init = shared
        .control(
            json!({"subtype": "initialize", "hooks": null}),
            start_timeout,
        )
        .await;
    match init {
        Ok(response) => {
            let current_mode = response
                .get("current_permission_mode")
                .and_then(Value::as_str)
                .map(str::to_owned)
                .or(spec.mode.clone());
            *lock(&shared.mode) = current_mode.clone();
            let info = SessionInfo {
                provider_session_id: Some(session_id.clone()),
                // A new session becomes resumable with its first prompt (the mapper
                // reports the handle then); until then there is nothing to reopen.
                persistence: resumed.then(|| json!({ "session_id": session_id })),
                pid: Some(pid),
                resumed,
                current_mode,
                current_model: spec.model.clone(),
            };
            stopper.handed_out();
            Ok((Box::new(ClaudeSession { shared, stopper }), info))
        }
        Err(e) => {
            let exit = stopper.stop().await;
            let ended = matches!(e, ProviderError::Gone);
            let why = match e {
                ProviderError::Gone => "the CLI stopped while starting".to_owned(),
                ProviderError::Protocol(m) if m.contains("no answer within") => format!(
                    "the CLI did not answer `initialize` within {} s; it was stopped",
                    start_timeout.as_secs()
                ),
                other => other.to_string(),
            };
            let why = if exit.is_empty() {
                why
            } else {
                format!("{why}: {exit}")
            };
            Err(if ended {
                StartFailure::Ended(why)
            } else {
                StartFailure::Other(ProviderError::Protocol(why))
            })
        }
    }
}

// ---------------------------------------------------------------------------------------
// The live session
// ---------------------------------------------------------------------------------------

struct ClaudeSession {
    shared: Arc<Shared>,
    stopper: Stopper,
}

#[async_trait]
impl ProviderSession for ClaudeSession {
    async fn prompt(&mut self, input: TurnInput) -> Result<(), ProviderError> {
        let session_id = lock(&self.shared.session_id).clone();
        let message = json!({
            "type": "user",
            "message": {"role": "user", "content": [{"type": "text", "text": input.text}]},
            "parent_tool_use_id": null,
            "session_id": session_id,
        });
        self.shared
            .io
            .writer
            .send(&message)
            .await
            .map_err(|_| ProviderError::Gone)
    }

    async fn interrupt(&mut self) -> Result<(), ProviderError> {
        // Requests the CLI waits on would hold the turn open: answer them first.
        let waiting: Vec<String> = lock(&self.shared.permissions).keys().cloned().collect();
        for request_id in waiting {
            self.shared
                .answer_permission(&request_id, PermissionDecision::Cancelled)
                .await;
        }
        let id = self.shared.controls.next_id();
        // The turn's end (`result`) is what matters; the response itself is not awaited.
        self.shared
            .io
            .writer
            .send(&json!({"type": "control_request", "request_id": id,
                "request": {"subtype": "interrupt"}}))
            .await
            .map_err(|_| ProviderError::Gone)
    }

    async fn set_mode(&mut self, mode: &str) -> Result<(), ProviderError> {
        let response = self
            .shared
            .control(
                json!({"subtype": "set_permission_mode", "mode": mode}),
                CONTROL_TIMEOUT,
            )
            .await?;
        let now = response
            .get("mode")
            .and_then(Value::as_str)
            .unwrap_or(mode)
            .to_owned();
        *lock(&self.shared.mode) = Some(now);
        Ok(())
    }

    async fn set_model(&mut self, model: &str) -> Result<(), ProviderError> {
        self.shared
            .control(
                json!({"subtype": "set_model", "model": model}),
                CONTROL_TIMEOUT,
            )
            .await
            .map(|_| ())
    }

    async fn close(mut self: Box<Self>) {
        self.stopper.stop().await;
    }
}

#[cfg(test)]
mod tests;
