//! Pi (`pi --mode rpc`), driven directly over its JSONL RPC: commands (`prompt`, `abort`,
//! `get_state`, `get_available_models`, `set_model`) on stdin, responses and events on
//! stdout (mapped in `mapping`). One process per session.
//!
//! Sessions: each agent has its own session file under the provider's state directory
//! (`<data_dir>/providers/<id>/sessions/<uuid>.jsonl`), passed with `--session`; the path
//! is the persistence handle, so a closed agent (or one whose server restarted) reopens
//! the same file with its history.
//!
//! Permissions: Pi never asks by design. agentry ships its own small extension (`gate.ts`,
//! written to the state directory and loaded with `-e`) that asks over Pi's extension UI
//! sub-protocol before `write`, `edit` and `bash` calls while the agent's mode is `ask`;
//! in `full-access` it lets them run. The mode lives in a small file next to the session
//! file that the gate reads on every call, so a live session can switch modes. A gate
//! dialog becomes a `permission_requested` of kind `tool` for its call; any other
//! extension's dialog one of kind `question`.
//!
//! Ordering: one task reads stdout and hands each line's events to the sink before it
//! reads the next, so `TurnEnded` (from `agent_end`) follows everything the turn
//! produced. The same task owns the process and sends `Exited` last.

pub mod mapping;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};

use self::mapping::{Action, Dialog, DialogMethod, Mapper};
use super::adapter::*;
use super::broker::{BrokerInput, Brokering, Credential, KeyHeader, PLACEHOLDER_KEY, upstream_url};
use super::stdio::{Cli, Io, JsonLines, Pending, Session};
use crate::domain::{Behavior, PermissionKind, PermissionOption};
use crate::process::line_writer::LineWriter;
use crate::process::output::{StderrTail, describe_exit};
use crate::process::{CommandSpec, lock};

/// How long Pi may take to answer its first `get_state` (it loads extensions first).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a command such as `set_model` may take to be answered.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(15);

const PROTOCOL: &str = "pi-rpc";

static CLI: Cli = Cli {
    name: "Pi",
    agent: "pi",
    stderr_log: "agentry::providers::pi::stderr",
    drain: Duration::from_millis(500),
    after_eof: Duration::from_secs(2),
};
/// The variable through which the gate extension finds its mode file.
const GATE_FILE_VAR: &str = "AGENTRY_PI_GATE_FILE";
/// The gate extension, written next to the sessions at start.
const GATE_SOURCE: &str = include_str!("gate.ts");

/// The mode in which the gate asks; the other one (`full-access`) lets everything run.
const ASK: &str = "ask";
const FULL_ACCESS: &str = "full-access";

/// The variables passed on from the server's environment: Pi's own and its built-in
/// model providers' (see `built_in_key`).
const PASS_ENV: &[&str] = &[
    "PI_CODING_AGENT_DIR",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_OAUTH_TOKEN",
    "OPENAI_API_KEY",
    "AZURE_OPENAI_API_KEY",
    "AZURE_OPENAI_BASE_URL",
    "AZURE_OPENAI_RESOURCE_NAME",
    "AZURE_OPENAI_API_VERSION",
    "AZURE_OPENAI_DEPLOYMENT_NAME_MAP",
    "DEEPSEEK_API_KEY",
    "GEMINI_API_KEY",
    "GROQ_API_KEY",
    "CEREBRAS_API_KEY",
    "XAI_API_KEY",
    "FIREWORKS_API_KEY",
    "OPENROUTER_API_KEY",
    "AI_GATEWAY_API_KEY",
    "ZAI_API_KEY",
    "MISTRAL_API_KEY",
    "MINIMAX_API_KEY",
];

/// The built-in descriptor of `pi`.
pub fn builtin() -> Builtin {
    Builtin {
        id: "pi",
        label: "Pi",
        program: "pi",
        pass_env: PASS_ENV,
        // No update checks, package checks or install telemetry from a server's CLI.
        env: &[("PI_OFFLINE", "1"), ("PI_SKIP_VERSION_CHECK", "1")],
        credential: Credential::Configured(broker),
        modes: MODES,
        default_mode: ASK,
        build: |cfg| Arc::new(PiProvider::new(cfg)),
    }
}

/// A variable Pi's built-in model providers read their key from (of those it is passed:
/// each one whose name ends so).
fn built_in_key(var: &str) -> bool {
    var.ends_with("_API_KEY") || var.ends_with("_OAUTH_TOKEN")
}

/// Pi's credentials under the egress proxy: the providers of `models.json` in its agent
/// directory (`PI_CODING_AGENT_DIR`). Each one with a `baseUrl` and
/// an `apiKey` (a variable's name, or the key itself) is brokered under
/// `…/pi/<provider>`: the sandbox is shown, in place of that `models.json`, a copy whose
/// `baseUrl` is the brokered URL and whose `apiKey` is the placeholder, and the proxy
/// sends on to the configured `baseUrl` with the key in the header of the provider's
/// `api`. A key of a built-in provider (a variable Pi reads by itself), or a key read by
/// a command, keeps every key inside.
fn broker(input: &BrokerInput<'_>) -> Result<Brokering, String> {
    if let Some(var) = PASS_ENV
        .iter()
        .find(|v| built_in_key(v) && input.set(v).is_some())
    {
        return Err(format!(
            "{var} is set: Pi's built-in providers are not brokered, only those of its models.json"
        ));
    }
    // Without it, Pi's agent directory is under the agent's own home in the sandbox,
    // which holds no configuration of the server's.
    let dir = PathBuf::from(input.set("PI_CODING_AGENT_DIR").ok_or_else(|| {
        "PI_CODING_AGENT_DIR is not set: Pi's configuration is its own, in the agent's home"
            .to_owned()
    })?);
    let path = dir.join("models.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "{} cannot be read ({e}): Pi uses its own login, kept in its agent directory",
            path.display()
        )
    })?;
    let mut models: Value = serde_json::from_str(&text)
        .ok()
        .filter(|v: &Value| v["providers"].is_object())
        .ok_or_else(|| format!("{} has no `providers` object", path.display()))?;
    let mut out = Brokering::default();
    let providers = models["providers"]
        .as_object_mut()
        .expect("checked to be an object");
    for (name, provider) in providers.iter_mut() {
        let Some(key_ref) = provider["apiKey"].as_str().map(str::to_owned) else {
            continue;
        };
        if key_ref.starts_with('!') {
            return Err(format!(
                "provider `{name}` reads its key with a command, which runs inside"
            ));
        }
        let key = match input.set(&key_ref) {
            Some(value) => {
                out.withhold.push(key_ref.clone());
                value
            }
            None => key_ref,
        };
        let Some(base) = provider["baseUrl"].as_str() else {
            return Err(format!(
                "provider `{name}` of models.json has a key but no baseUrl"
            ));
        };
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        {
            return Err(format!(
                "the provider name `{name}` cannot name a brokered path (use letters, digits, `-`, `_`, `.`)"
            ));
        }
        let upstream_base = upstream_url(base)
            .ok_or_else(|| format!("provider `{name}`'s baseUrl is not an http(s) URL"))?;
        let header = match provider["api"].as_str() {
            Some("anthropic-messages") => KeyHeader::Named("x-api-key"),
            Some("google-generative-ai") => KeyHeader::Named("x-goog-api-key"),
            _ => KeyHeader::Bearer,
        };
        let prefix = format!("pi/{name}");
        provider["baseUrl"] = json!(crate::egress::brokered_base_url(&prefix));
        provider["apiKey"] = json!(PLACEHOLDER_KEY);
        out.brokered
            .push(input.brokered(prefix, upstream_base, header, key));
    }
    if out.brokered.is_empty() {
        return Err(format!(
            "no provider of {} has a key: Pi uses its own login, kept in its agent directory",
            path.display()
        ));
    }
    out.files.push((path, models.to_string()));
    Ok(out)
}

/// Pi has no modes of its own; these are agentry's, made by its gate extension.
#[rustfmt::skip]
const MODES: &[ModeRow] = &[
    (ASK, "Ask", "agentry's gate extension asks before every write, edit and bash call (Pi itself never asks)", false),
    (FULL_ACCESS, "Full access", "Every tool runs without asking (Pi's own behaviour)", true),
];

/// Pi as a provider.
pub struct PiProvider {
    cfg: CliConfig,
    start_timeout: Duration,
}

impl PiProvider {
    pub fn new(cfg: CliConfig) -> Self {
        Self {
            cfg,
            start_timeout: START_TIMEOUT,
        }
    }

    /// Where this provider keeps its gate extension and the agents' session files.
    fn state_dir(&self) -> PathBuf {
        self.cfg
            .state_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("agentry-pi").join(&self.cfg.id))
    }

    /// The command with the protocol flags in `flags` and `env` on top of the settings'.
    fn command(
        &self,
        flags: &[String],
        cwd: PathBuf,
        env: &[(&str, String)],
    ) -> Result<CommandSpec, ProviderError> {
        let mut command = self.cfg.command(flags, cwd)?;
        command
            .env
            .extend(env.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
        Ok(command)
    }

    /// Write the gate extension (when it is not there already, or differs) and return
    /// its path.
    fn install_gate(&self) -> Result<PathBuf, ProviderError> {
        let dir = self.state_dir();
        let path = dir.join("agentry-gate.ts");
        if std::fs::read_to_string(&path).ok().as_deref() != Some(GATE_SOURCE) {
            std::fs::create_dir_all(&dir).map_err(|e| state_error(&dir, e))?;
            write_atomically(&path, GATE_SOURCE).map_err(|e| state_error(&path, e))?;
        }
        Ok(path)
    }
}

fn state_error(path: &Path, e: std::io::Error) -> ProviderError {
    ProviderError::Unavailable(format!("cannot write {}: {e}", path.display()))
}

/// Replace `path` with `text` so a reader never sees half of it.
fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", uuid::Uuid::now_v7().simple()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// The session file named by a persistence handle.
fn session_file_of(handle: Option<&Value>) -> Option<PathBuf> {
    handle
        .and_then(|h| h.get("session_file"))
        .and_then(Value::as_str)
        .filter(|f| !f.is_empty())
        .map(PathBuf::from)
}

/// `provider/id` of a Pi model object.
fn model_id(model: &Value) -> Option<String> {
    let id = model.get("id").and_then(Value::as_str)?;
    Some(match model.get("provider").and_then(Value::as_str) {
        Some(provider) => format!("{provider}/{id}"),
        None => id.to_owned(),
    })
}

/// The catalog of a `get_available_models` answer; `current` is marked the default.
fn models_of(data: &Value, current: Option<&str>) -> Vec<ModelInfo> {
    data["models"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let id = model_id(m)?;
            Some(ModelInfo {
                label: m
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or(&id)
                    .to_owned(),
                is_default: current == Some(id.as_str()),
                context_window: m.get("contextWindow").and_then(Value::as_u64),
                id,
            })
        })
        .collect()
}

#[async_trait]
impl Provider for PiProvider {
    fn info(&self) -> ProviderInfo {
        let mut info = self.cfg.info(PROTOCOL);
        info.capabilities.mcp_servers = false;
        info
    }

    async fn availability(&self) -> Availability {
        if let Some(why) = command_missing(&self.cfg.command) {
            return Availability::Unavailable(why);
        }
        Availability::Available
    }

    async fn models(&self, probe: &Probe) -> Result<Vec<ModelInfo>, ProviderError> {
        let flags: Vec<String> = ["--mode", "rpc", "--no-session"]
            .iter()
            .map(|f| (*f).to_owned())
            .collect();
        let spec = self.command(&flags, probe.cwd.clone(), &[])?;
        let mut child = probe.launcher.launch(spec).await?;
        let Some((stdin, stdout, stderr)) = child.take_stdio().await else {
            return Err(ProviderError::Protocol("Pi has no piped stdio".to_owned()));
        };
        let (tail, reader) =
            StderrTail::capture_masked(stderr, "agentry::providers::pi::stderr", child.redactor());
        let writer = LineWriter::new(stdin);
        let ask = async {
            writer
                .send(&json!({"id": "state", "type": "get_state"}))
                .await
                .map_err(|_| ProviderError::Gone)?;
            writer
                .send(&json!({"id": "models", "type": "get_available_models"}))
                .await
                .map_err(|_| ProviderError::Gone)?;
            let mut lines = JsonLines::new(stdout, CLI.name);
            let mut mapper = Mapper::new(&probe.cwd);
            let mut current = None;
            while let Some(message) = lines.next_message().await {
                for action in mapper.map(&message) {
                    if let Action::Response { id, result, .. } = action {
                        match (id.as_deref(), result) {
                            (Some("state"), Ok(state)) => current = model_id(&state["model"]),
                            (Some("models"), Ok(data)) => {
                                return Ok(models_of(&data, current.as_deref()));
                            }
                            (Some("models"), Err(e)) => return Err(ProviderError::Protocol(e)),
                            _ => {}
                        }
                    }
                }
            }
            Err(ProviderError::Gone)
        };
        let result = match tokio::time::timeout(self.start_timeout, ask).await {
            Ok(result) => result,
            Err(_) => Err(ProviderError::Protocol(format!(
                "Pi did not list its models within {} s",
                self.start_timeout.as_secs()
            ))),
        };
        writer.close().await;
        let status = child.wind_down(None, CLI.after_eof).await;
        reader.settle().await;
        match result {
            Err(ProviderError::Gone) => Err(ProviderError::Protocol(describe_exit(
                status,
                Some("Pi stopped before it listed its models"),
                &tail.tail(),
            ))),
            other => other,
        }
    }

    async fn start(&self, spec: SessionSpec, launcher: Launcher, events: EventSink) -> Started {
        let gate = self.install_gate()?;
        let sessions = self.state_dir().join("sessions");
        std::fs::create_dir_all(&sessions).map_err(|e| state_error(&sessions, e))?;
        let session_file = session_file_of(spec.resume.as_ref())
            .unwrap_or_else(|| sessions.join(format!("{}.jsonl", uuid::Uuid::now_v7())));
        // Pi writes the file once the conversation has something in it: a session closed
        // before its first prompt has nothing to reopen.
        let resumed = session_file.is_file();
        let mode = self.cfg.mode_or_default(spec.mode.as_deref(), ASK);
        let mode_file = session_file.with_extension("mode");
        if let Some(dir) = mode_file.parent() {
            std::fs::create_dir_all(dir).map_err(|e| state_error(dir, e))?;
        }
        write_atomically(&mode_file, &mode).map_err(|e| state_error(&mode_file, e))?;

        let mut flags: Vec<String> = vec![
            "--mode".into(),
            "rpc".into(),
            "--session".into(),
            session_file.display().to_string(),
            "-e".into(),
            gate.display().to_string(),
        ];
        if let Some(model) = &spec.model {
            flags.push("--model".into());
            flags.push(model.clone());
        }
        if let Some(prompt) = &spec.system_prompt {
            flags.push("--append-system-prompt".into());
            flags.push(prompt.clone());
        }
        let command = self.command(
            &flags,
            spec.cwd.clone(),
            &[(GATE_FILE_VAR, mode_file.display().to_string())],
        )?;

        let (io, process) = CLI.launch(launcher.as_ref(), command, events).await?;
        let pid = process.pid();
        let shared = Arc::new(Shared {
            io,
            commands: Pending::default(),
            dialogs: Mutex::new(HashMap::new()),
            mode_file,
            running: AtomicBool::new(false),
            abort_on_start: AtomicBool::new(false),
        });
        let (mut stopper, signals) = Stopper::new();
        tokio::spawn(CLI.supervise(process, shared.clone(), Mapper::new(&spec.cwd), signals));

        let state = shared
            .command(json!({"type": "get_state"}), self.start_timeout)
            .await;
        match state {
            Ok(state) => {
                // Pi starts an empty conversation over a session file it cannot read,
                // without a word: say so rather than claim a resume.
                let lost = resumed && state["messageCount"].as_u64() == Some(0);
                if lost {
                    tracing::warn!(file = %session_file.display(), "Pi found no conversation in the session file");
                    shared
                        .io
                        .events
                        .emit(ProviderEvent::Error {
                            message: format!(
                                "Pi could not read the earlier conversation in {}; a new conversation was started",
                                session_file.display()
                            ),
                            code: Some("resume_failed".to_owned()),
                        })
                        .await;
                }
                let resumed = resumed && !lost;
                if !spec.mcp_servers.is_empty() {
                    shared
                        .io
                        .events
                        .emit(ProviderEvent::Error {
                            message: "Pi does not support MCP servers; the agent's MCP servers are not available to it".to_owned(),
                            code: Some("mcp_unsupported".to_owned()),
                        })
                        .await;
                }
                let info = SessionInfo {
                    provider_session_id: state["sessionId"].as_str().map(str::to_owned),
                    persistence: Some(json!({"session_file": session_file.display().to_string()})),
                    pid: Some(pid),
                    resumed,
                    current_mode: Some(mode),
                    current_model: model_id(&state["model"]).or(spec.model.clone()),
                };
                stopper.handed_out();
                Ok((Box::new(PiSession { shared, stopper }), info))
            }
            Err(e) => {
                let exit = stopper.stop().await;
                let why = match e {
                    ProviderError::Gone => "Pi stopped while starting".to_owned(),
                    other => other.to_string(),
                };
                Err(ProviderError::Protocol(if exit.is_empty() {
                    why
                } else {
                    format!("{why}: {exit}")
                }))
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Session state shared by the reader, the session handle and dialog answers
// ---------------------------------------------------------------------------------------

struct Shared {
    io: Io,
    /// Our commands waiting for their response.
    commands: Pending,
    /// Dialogs not answered yet. Whoever removes an entry (the person's answer, an
    /// interrupt, Pi's own timeout) answers it or drops it.
    dialogs: Mutex<HashMap<String, Dialog>>,
    /// The file the gate extension reads the mode from.
    mode_file: PathBuf,
    /// Pi is running a prompt (between `agent_start` and `agent_end`).
    running: AtomicBool,
    /// An interrupt came after the prompt was sent but before Pi started on it (Pi
    /// ignores an `abort` then): abort as soon as it starts.
    abort_on_start: AtomicBool,
}

impl Shared {
    fn next_id(&self) -> String {
        self.commands.next_id()
    }

    /// Send a command and wait (at most `timeout`) for its response's `data`.
    async fn command(&self, mut command: Value, timeout: Duration) -> Result<Value, ProviderError> {
        let id = self.next_id();
        command["id"] = json!(id);
        let name = command["type"].as_str().unwrap_or("command").to_owned();
        self.commands
            .ask(&self.io.writer, id, &name, &command, timeout)
            .await
    }
}

impl Session for Shared {
    type Mapper = Mapper;

    fn io(&self) -> &Io {
        &self.io
    }

    fn forget(&self) {
        self.commands.clear();
        lock(&self.dialogs).clear();
    }

    async fn handle(self: &Arc<Self>, mapper: &mut Mapper, message: &Value) {
        match message["type"].as_str() {
            Some("agent_start") => {
                self.running.store(true, Ordering::Release);
                if self.abort_on_start.swap(false, Ordering::AcqRel) {
                    let abort = json!({"id": self.next_id(), "type": "abort"});
                    let _ = self.io.writer.send(&abort).await;
                }
            }
            Some("agent_end") => self.running.store(false, Ordering::Release),
            _ => {}
        }
        for action in mapper.map(message) {
            match action {
                Action::Event(event) => self.io.events.emit(event).await,
                Action::Response {
                    id,
                    command,
                    result,
                } => {
                    let unanswered = match &id {
                        Some(id) => self.commands.answer(id, result),
                        None => Err(result),
                    };
                    match unanswered {
                        Ok(()) | Err(Ok(_)) => {}
                        // A prompt Pi refused never starts a turn: end it here.
                        Err(Err(error)) if command == "prompt" => {
                            self.io
                                .events
                                .emit(ProviderEvent::TurnEnded {
                                    outcome: crate::domain::TurnOutcome::Failed,
                                    error: Some(format!("Pi refused the prompt: {error}")),
                                    usage: None,
                                })
                                .await;
                        }
                        Err(Err(error)) => {
                            tracing::debug!(%command, %error, "Pi refused a command");
                        }
                    }
                }
                Action::Dialog(dialog) => self.raise_dialog(dialog).await,
            }
        }
    }
}

impl Shared {
    async fn raise_dialog(self: &Arc<Self>, dialog: Dialog) {
        let (kind, call_id, input, options) = match &dialog.gate {
            Some(gate) => (
                PermissionKind::Tool,
                Some(gate.call_id.clone()),
                Some(gate.input.clone()),
                allow_deny("Allow", "Deny"),
            ),
            None => (
                PermissionKind::Question,
                None,
                Some(json!({
                    "method": method_name(dialog.method),
                    "message": dialog.message,
                    "options": dialog.options,
                })),
                question_options(&dialog),
            ),
        };
        let id = dialog.id.clone();
        let ask = Ask {
            kind,
            title: dialog.title.clone(),
            call_id,
            input,
            options,
        };
        let timeout = dialog.timeout_ms;
        lock(&self.dialogs).insert(id.clone(), dialog);
        let answer = self.io.events.ask(id.clone(), ask).await;
        let shared = self.clone();
        let answered = id.clone();
        tokio::spawn(async move {
            let decision = answer.await.unwrap_or(PermissionDecision::Cancelled);
            shared.answer_dialog(&answered, decision).await;
        });
        // Pi answers a timed dialog itself: then the request is withdrawn.
        if let Some(ms) = timeout {
            let shared = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                if lock(&shared.dialogs).remove(&id).is_some() {
                    shared
                        .io
                        .events
                        .emit(ProviderEvent::PermissionWithdrawn {
                            provider_request_id: id,
                        })
                        .await;
                }
            });
        }
    }

    /// Answer dialog `id`, unless someone already did.
    async fn answer_dialog(&self, id: &str, decision: PermissionDecision) {
        let Some(dialog) = lock(&self.dialogs).remove(id) else {
            return;
        };
        let response = dialog_response(&dialog, decision);
        if self.io.writer.send(&response).await.is_err() {
            tracing::debug!("Pi is gone; a dialog answer was not delivered");
        }
    }
}

fn method_name(method: DialogMethod) -> &'static str {
    match method {
        DialogMethod::Select => "select",
        DialogMethod::Confirm => "confirm",
        DialogMethod::Input => "input",
        DialogMethod::Editor => "editor",
    }
}

fn allow_deny(allow: &str, deny: &str) -> Vec<PermissionOption> {
    vec![
        PermissionOption {
            id: "allow".to_owned(),
            label: allow.to_owned(),
            behavior: Behavior::Allow,
        },
        PermissionOption {
            id: "deny".to_owned(),
            label: deny.to_owned(),
            behavior: Behavior::Deny,
        },
    ]
}

/// The options of another extension's dialog: a `select`'s choices (`option_<n>`, each
/// an allow) and a `deny` that dismisses it; `confirm` yes/no; `input`/`editor` allow
/// (with the text as the answer's message) or deny.
fn question_options(dialog: &Dialog) -> Vec<PermissionOption> {
    match dialog.method {
        DialogMethod::Select => {
            let mut options: Vec<PermissionOption> = dialog
                .options
                .iter()
                .enumerate()
                .map(|(n, label)| PermissionOption {
                    id: format!("option_{n}"),
                    label: label.clone(),
                    behavior: Behavior::Allow,
                })
                .collect();
            options.push(PermissionOption {
                id: "deny".to_owned(),
                label: "Dismiss".to_owned(),
                behavior: Behavior::Deny,
            });
            options
        }
        DialogMethod::Confirm => allow_deny("Yes", "No"),
        DialogMethod::Input | DialogMethod::Editor => allow_deny("Answer", "Dismiss"),
    }
}

/// The `extension_ui_response` for a decision on `dialog`.
fn dialog_response(dialog: &Dialog, decision: PermissionDecision) -> Value {
    let id = &dialog.id;
    let cancelled = json!({"type": "extension_ui_response", "id": id, "cancelled": true});
    let PermissionDecision::Selected {
        option_id,
        behavior,
        message,
        ..
    } = decision
    else {
        return cancelled;
    };
    match dialog.method {
        DialogMethod::Confirm => json!({"type": "extension_ui_response", "id": id,
            "confirmed": behavior == Behavior::Allow}),
        DialogMethod::Select => {
            let chosen = option_id
                .strip_prefix("option_")
                .and_then(|n| n.parse::<usize>().ok())
                .and_then(|n| dialog.options.get(n));
            match (behavior, chosen) {
                (Behavior::Allow, Some(value)) => {
                    json!({"type": "extension_ui_response", "id": id, "value": value})
                }
                _ => cancelled,
            }
        }
        DialogMethod::Input | DialogMethod::Editor => match behavior {
            Behavior::Allow => json!({"type": "extension_ui_response", "id": id,
                "value": message.unwrap_or_default()}),
            Behavior::Deny => cancelled,
        },
    }
}

// ---------------------------------------------------------------------------------------
// Reading and supervising
// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// The live session
// ---------------------------------------------------------------------------------------

struct PiSession {
    shared: Arc<Shared>,
    stopper: Stopper,
}

#[async_trait]
impl ProviderSession for PiSession {
    async fn prompt(&mut self, input: TurnInput) -> Result<(), ProviderError> {
        // The response only says the prompt was accepted; a refusal ends the turn (see
        // `Shared::handle`), everything else arrives as events.
        let id = self.shared.next_id();
        self.shared.abort_on_start.store(false, Ordering::Release);
        self.shared
            .io
            .writer
            .send(&json!({"id": id, "type": "prompt", "message": input.text}))
            .await
            .map_err(|_| ProviderError::Gone)
    }

    async fn interrupt(&mut self) -> Result<(), ProviderError> {
        // A dialog Pi waits on would hold the turn open: dismiss it first.
        let waiting: Vec<String> = lock(&self.shared.dialogs).keys().cloned().collect();
        for id in waiting {
            self.shared
                .answer_dialog(&id, PermissionDecision::Cancelled)
                .await;
        }
        if !self.shared.running.load(Ordering::Acquire) {
            self.shared.abort_on_start.store(true, Ordering::Release);
        }
        let id = self.shared.next_id();
        // `agent_end` ends the turn; the response itself is not awaited.
        self.shared
            .io
            .writer
            .send(&json!({"id": id, "type": "abort"}))
            .await
            .map_err(|_| ProviderError::Gone)
    }

    async fn set_mode(&mut self, mode: &str) -> Result<(), ProviderError> {
        if mode != ASK && mode != FULL_ACCESS {
            return Err(ProviderError::Protocol(format!(
                "Pi has no mode `{mode}`; its modes are `{ASK}` and `{FULL_ACCESS}`"
            )));
        }
        write_atomically(&self.shared.mode_file, mode)
            .map_err(|e| state_error(&self.shared.mode_file, e))
    }

    async fn set_model(&mut self, model: &str) -> Result<(), ProviderError> {
        let (provider, id) = match model.split_once('/') {
            Some((provider, id)) => (provider.to_owned(), id.to_owned()),
            None => {
                // A bare id: find its provider in Pi's catalog.
                let data = self
                    .shared
                    .command(json!({"type": "get_available_models"}), COMMAND_TIMEOUT)
                    .await?;
                let found = data["models"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|m| m["id"] == model)
                    .and_then(|m| m["provider"].as_str().map(str::to_owned));
                let Some(provider) = found else {
                    return Err(ProviderError::Protocol(format!(
                        "Pi knows no model `{model}`"
                    )));
                };
                (provider, model.to_owned())
            }
        };
        self.shared
            .command(
                json!({"type": "set_model", "provider": provider, "modelId": id}),
                COMMAND_TIMEOUT,
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
