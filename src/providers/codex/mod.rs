//! The `codex` provider: Codex's `app-server`, JSON-RPC over stdio with no version field.
//! A session is one Codex thread (`thread/start`, or `thread/resume` from the persistence
//! handle `{"thread_id": …}`); a prompt is a `turn/start`, an interrupt `turn/interrupt`.
//! Modes are Codex's approval policy and sandbox, applied on the next turn; so is a model
//! change. What Codex sends is mapped in `mapping`.
//!
//! Tasks: a dispatcher reads Codex's messages in order and hands their events to the sink
//! (approval answers are awaited off it); a supervisor owns the process and sends
//! `Exited` last, after the dispatcher has drained what the process wrote.

mod mapping;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

pub use mapping::{Ask, Mapped, Mapper, decision_reply};

use super::adapter::*;
use super::broker::{BrokerInput, Brokering, Credential, KeyHeader, PLACEHOLDER_KEY, upstream_url};
use super::mcp;
use super::supervise::{Exit, drain, tail_suffix, watch};
use crate::domain::TurnOutcome;
use crate::process::jsonrpc::{Incoming, Peer, PeerOptions, RequestId, RpcError};
use crate::process::output::{StderrReader, StderrTail};
use crate::process::{ManagedChild, STOP_GRACE, lock};

/// How long Codex may take to initialize and open its thread.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a catalog probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);
/// After the process is gone, how long the rest of its output may take to be handled.
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(1);
/// How long `turn/interrupt` may take to be acknowledged.
const INTERRUPT_TIMEOUT: Duration = Duration::from_secs(10);

const PASS_ENV: &[&str] = &[
    "OPENAI_API_KEY",
    "CODEX_API_KEY",
    "CODEX_HOME",
    "OPENAI_BASE_URL",
];

/// The built-in descriptor.
pub fn builtin() -> Builtin {
    Builtin {
        id: "codex",
        label: "Codex",
        program: "codex",
        pass_env: PASS_ENV,
        env: &[],
        credential: Credential::Configured(broker),
        modes: MODES,
        default_mode: "auto",
        build: |cfg| Arc::new(CodexProvider::new(cfg)),
    }
}

#[rustfmt::skip]
const MODES: &[ModeRow] = &[
    ("read-only", "Read only", "Reads freely in a read-only sandbox; asks before running anything else", false),
    ("auto", "Auto", "Edits and runs commands inside the workspace sandbox; asks to go beyond it", false),
    ("full-access", "Full access", "Runs anything without a sandbox and never asks", true),
];

/// A mode as Codex's approval policy, thread sandbox mode and turn sandbox policy.
/// `confined`: Codex runs inside agentry's sandbox, which already gives `auto` what
/// Codex's workspace sandbox would (the worktree writable, nothing else of the host), and
/// in which Codex's own sandbox cannot start; `auto` then runs without Codex's, under
/// agentry's. `read-only` keeps Codex's read-only sandbox: where it cannot start, Codex
/// asks before running each command, which is what the mode promises.
fn policy(mode: &str, confined: bool) -> Option<(&'static str, &'static str, Value)> {
    match mode {
        "auto" if confined => Some((
            "on-request",
            "danger-full-access",
            json!({"type": "dangerFullAccess"}),
        )),
        "read-only" => Some(("untrusted", "read-only", json!({"type": "readOnly"}))),
        "auto" => Some((
            "on-request",
            "workspace-write",
            json!({"type": "workspaceWrite"}),
        )),
        "full-access" => Some((
            "never",
            "danger-full-access",
            json!({"type": "dangerFullAccess"}),
        )),
        _ => None,
    }
}

pub struct CodexProvider {
    cfg: CliConfig,
    start_timeout: Duration,
}

impl CodexProvider {
    pub fn new(cfg: CliConfig) -> Self {
        Self {
            cfg,
            start_timeout: START_TIMEOUT,
        }
    }

    fn mode_of(&self, requested: Option<&str>) -> Result<String, ProviderError> {
        let mode = self.cfg.mode_or_default(requested, "auto");
        if policy(&mode, false).is_none() {
            return Err(ProviderError::Protocol(format!(
                "unknown Codex mode `{mode}` (known: read-only, auto, full-access)"
            )));
        }
        Ok(mode)
    }

    /// The CLI itself is given variable `var`, or reads it: an MCP server's variable
    /// of that name cannot travel in the CLI's environment.
    fn gives(&self, var: &str) -> bool {
        var.starts_with("CODEX_")
            || var.starts_with("AGENTRY_")
            || crate::process::BASE_ENV.contains(&var)
            || self.cfg.team_secrets.iter().any(|t| t == var)
            || self.cfg.child_var(var).is_some()
    }

    /// The variables the CLI may read its model key from: its own two, and the `env_key`
    /// of a model provider the args define. Its shell commands never see them, whether
    /// they hold the key (not brokered) or the placeholder.
    fn credential_vars(&self) -> Vec<String> {
        let mut vars = vec!["OPENAI_API_KEY".to_owned(), "CODEX_API_KEY".to_owned()];
        if let Some(key) = custom_model_provider(&self.cfg.args).and_then(|p| p.env_key) {
            vars.push(key);
        }
        vars
    }

    /// Start the CLI in `cwd` with the agent's MCP servers and initialize it.
    async fn launch(
        &self,
        launcher: &dyn ProcessLauncher,
        cwd: PathBuf,
        mcp_servers: &BTreeMap<String, Value>,
    ) -> Result<Connection, ProviderError> {
        let mut protocol = vec![
            "app-server".to_owned(),
            "--disable".to_owned(),
            "plugins".to_owned(),
        ];
        let (overrides, mcp_env) =
            mcp_overrides(mcp_servers, |var| self.gives(var), &self.credential_vars())?;
        protocol.extend(overrides);
        let mut command = self.cfg.command(&protocol, cwd)?;
        command.secret_env = mcp_env;
        let mut child = launcher.launch(command).await?;
        let Some((stdin, stdout, stderr)) = child.take_stdio().await else {
            return Err(ProviderError::Protocol(
                "the Codex process has no piped stdio".to_owned(),
            ));
        };
        let (stderr, stderr_task) =
            StderrTail::capture_masked(stderr, "agentry::providers::codex", child.redactor());
        let (peer, incoming) = Peer::start(
            stdout,
            stdin,
            PeerOptions {
                version_field: false,
                ..PeerOptions::default()
            },
        );
        Ok(Connection {
            child,
            peer,
            incoming,
            stderr,
            stderr_task,
        })
    }
}

/// A started CLI before its session exists.
struct Connection {
    child: ManagedChild,
    peer: Peer,
    incoming: mpsc::Receiver<Incoming>,
    stderr: StderrTail,
    stderr_task: StderrReader,
}

async fn initialize(peer: &Peer, timeout: Duration) -> Result<(), RpcError> {
    peer.request(
        "initialize",
        json!({
            "clientInfo": {
                "name": "agentry",
                "title": "agentry",
                "version": env!("CARGO_PKG_VERSION"),
            },
            "capabilities": null,
        }),
        timeout,
    )
    .await?;
    peer.notify("initialized", None).await
}

#[async_trait]
impl Provider for CodexProvider {
    fn info(&self) -> ProviderInfo {
        self.cfg.info("codex-app-server")
    }

    async fn availability(&self) -> Availability {
        if let Some(why) = command_missing(&self.cfg.command) {
            return Availability::Unavailable(why);
        }
        match credentials(&self.cfg, |p| p.is_file()) {
            Ok(()) => Availability::Available,
            Err(why) => Availability::Unavailable(why),
        }
    }

    async fn models(&self, probe: &Probe) -> Result<Vec<ModelInfo>, ProviderError> {
        let mut conn = self
            .launch(probe.launcher.as_ref(), probe.cwd.clone(), &BTreeMap::new())
            .await?;
        // Nobody needs what Codex announces meanwhile.
        let mut incoming = std::mem::replace(&mut conn.incoming, mpsc::channel(1).1);
        let drain = tokio::spawn(async move { while incoming.recv().await.is_some() {} });
        let listed = tokio::time::timeout(PROBE_TIMEOUT, list_models(&conn.peer)).await;
        conn.child.terminate(STOP_GRACE).await;
        drain.abort();
        conn.stderr_task.settle().await;
        match listed {
            Ok(Ok(models)) => Ok(models),
            Ok(Err(e)) => Err(ProviderError::Protocol(format!(
                "listing Codex models failed: {e}{}",
                tail_suffix("stderr", &conn.stderr)
            ))),
            Err(_) => Err(ProviderError::Protocol(format!(
                "Codex did not list its models within {} s{}",
                PROBE_TIMEOUT.as_secs(),
                tail_suffix("stderr", &conn.stderr)
            ))),
        }
    }

    async fn start(&self, spec: SessionSpec, launcher: Launcher, events: EventSink) -> Started {
        let mode = self.mode_of(spec.mode.as_deref())?;
        let conn = self
            .launch(launcher.as_ref(), spec.cwd.clone(), &spec.mcp_servers)
            .await?;
        let pid = conn.child.pid();
        let shared = Arc::new(Shared {
            events: Emitter::new(events),
            peer: conn.peer.clone(),
            turn: Mutex::new(TurnState::default()),
            asks: Mutex::new(HashMap::new()),
            interrupt_epoch: watch::channel(0).0,
            stderr: conn.stderr.clone(),
        });
        let dispatcher = tokio::spawn(dispatch(conn.incoming, shared.clone()));
        let (mut stopper, signals) = Stopper::new();
        tokio::spawn(supervise(
            conn.child,
            conn.stderr_task,
            dispatcher,
            shared.clone(),
            signals,
        ));

        let confined = launcher.confined();
        let opened = tokio::time::timeout(
            self.start_timeout,
            open_thread(&conn.peer, &spec, &mode, confined),
        )
        .await;
        let failure = match opened {
            Ok(Ok(thread)) => {
                let info = SessionInfo {
                    provider_session_id: Some(thread.id.clone()),
                    persistence: Some(thread.persistence()),
                    pid: Some(pid),
                    resumed: thread.resumed,
                    current_mode: Some(mode.clone()),
                    current_model: thread.model.clone(),
                };
                stopper.handed_out();
                let session = CodexSession {
                    thread_id: thread.id,
                    shared,
                    mode,
                    confined,
                    model: thread.model,
                    unsent_policy: false,
                    unsent_model: false,
                    stopper,
                };
                return Ok((Box::new(session), info));
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!(
                "Codex did not start within {} s",
                self.start_timeout.as_secs_f32()
            ),
        };
        // The session never started: stop the process, no events, say why.
        let exit = stopper.stop().await;
        Err(ProviderError::Protocol(format!("{failure} ({exit})")))
    }
}

async fn list_models(peer: &Peer) -> Result<Vec<ModelInfo>, RpcError> {
    initialize(peer, PROBE_TIMEOUT).await?;
    let mut models = Vec::new();
    let mut cursor: Option<String> = None;
    // A catalog is a page or two; the bound only guards against a cursor that loops.
    for _ in 0..20 {
        let params = match &cursor {
            Some(c) => json!({ "cursor": c }),
            None => json!({}),
        };
        let page = peer.request("model/list", params, PROBE_TIMEOUT).await?;
        models.extend(catalog(&page));
        cursor = page
            .get("nextCursor")
            .and_then(Value::as_str)
            .map(str::to_owned);
        if cursor.is_none() {
            break;
        }
    }
    Ok(models)
}

/// The visible models of a `model/list` page.
fn catalog(page: &Value) -> Vec<ModelInfo> {
    page.get("data")
        .and_then(Value::as_array)
        .map(|models| {
            models
                .iter()
                .filter(|m| m.get("hidden").and_then(Value::as_bool) != Some(true))
                .filter_map(|m| {
                    let id = m
                        .get("id")
                        .or_else(|| m.get("model"))
                        .and_then(Value::as_str)?;
                    Some(ModelInfo {
                        id: id.to_owned(),
                        label: m
                            .get("displayName")
                            .and_then(Value::as_str)
                            .unwrap_or(id)
                            .to_owned(),
                        is_default: m.get("isDefault").and_then(Value::as_bool) == Some(true),
                        context_window: None,
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether Codex will find credentials: a key variable, a login file, or a custom model
/// provider (from `args`) whose key variable is set or which needs none.
fn credentials(cfg: &CliConfig, exists: impl Fn(&std::path::Path) -> bool) -> Result<(), String> {
    if let Some(provider) = custom_model_provider(&cfg.args) {
        return match provider.env_key {
            None => Ok(()),
            Some(key) if cfg.var_is_set(&key) => Ok(()),
            Some(key) => Err(format!(
                "no credentials: the model provider `{}` reads its key from {key}, which is not set",
                provider.name
            )),
        };
    }
    for key in ["OPENAI_API_KEY", "CODEX_API_KEY"] {
        if cfg.var_is_set(key) {
            return Ok(());
        }
    }
    let home = cfg.child_var("CODEX_HOME").map(PathBuf::from).or_else(|| {
        cfg.child_var("HOME")
            .map(|h| PathBuf::from(h).join(".codex"))
    });
    let auth = home.map(|h| h.join("auth.json"));
    if let Some(auth) = &auth
        && exists(auth)
    {
        return Ok(());
    }
    Err(format!(
        "no credentials: neither OPENAI_API_KEY nor CODEX_API_KEY is set and {} does not exist (run `codex login`)",
        auth.map_or_else(
            || "no auth.json (CODEX_HOME and HOME are unset)".to_owned(),
            |a| a.display().to_string()
        )
    ))
}

struct CustomModelProvider {
    name: String,
    env_key: Option<String>,
}

/// The `-c key=value` (`--config`) overrides of `args`, in order, values parsed as Codex
/// parses them (TOML, else a plain string).
fn config_overrides(args: &[String]) -> Vec<(String, toml::Value)> {
    let mut overrides: Vec<(String, toml::Value)> = Vec::new();
    let mut words = args.iter();
    while let Some(word) = words.next() {
        let pair = match word.as_str() {
            "-c" | "--config" => words.next().map(String::as_str),
            w => w.strip_prefix("--config="),
        };
        let Some((key, raw)) = pair.and_then(|p| p.split_once('=')) else {
            continue;
        };
        let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(raw.to_owned()));
        overrides.push((key.trim().to_owned(), value));
    }
    overrides
}

/// The value of field `field` of model provider `name` as `overrides` leave it (a later
/// override wins; setting the whole table drops the fields set before it).
fn provider_field(overrides: &[(String, toml::Value)], name: &str, field: &str) -> Option<String> {
    let table_key = format!("model_providers.{name}");
    let field_key = format!("{table_key}.{field}");
    overrides.iter().rev().find_map(|(key, value)| {
        if *key == field_key {
            Some(value.as_str().map(str::to_owned))
        } else if *key == table_key {
            Some(
                value
                    .get(field)
                    .and_then(toml::Value::as_str)
                    .map(str::to_owned),
            )
        } else {
            None
        }
    })?
}

/// The path of Codex's model API under an agent's egress endpoint.
const BROKER_PREFIX: &str = "openai";

/// Codex's credential under the egress proxy. With a model provider the `args` define
/// (`model_provider=<name>` and its `base_url`, `env_key`), that provider's `base_url` is
/// overridden with the brokered URL and its `env_key` variable holds the placeholder; the
/// proxy sends on to the configured `base_url` with `Authorization: Bearer <key>`. With
/// Codex's own OpenAI provider and `OPENAI_API_KEY` (or `CODEX_API_KEY`), `openai_base_url`
/// is overridden, the upstream being the one `args` or `OPENAI_BASE_URL` name, else
/// OpenAI's API.
fn broker(input: &BrokerInput<'_>) -> Result<Brokering, String> {
    let overrides = config_overrides(input.args);
    let brokered_url = crate::egress::brokered_base_url(BROKER_PREFIX);
    let chosen = overrides
        .iter()
        .rev()
        .find(|(k, _)| k == "model_provider")
        .and_then(|(_, v)| v.as_str())
        .filter(|name| *name != "openai");
    let (upstream, key_var, args, mut withhold) = match chosen {
        Some(name) => {
            let base = provider_field(&overrides, name, "base_url").ok_or_else(|| {
                format!(
                    "the model provider `{name}` has no `base_url` in the provider's args \
                     (a provider of Codex's own or of its config file is not rewritten)"
                )
            })?;
            if provider_field(&overrides, name, "experimental_bearer_token").is_some() {
                return Err(format!(
                    "the model provider `{name}` carries its token in the configuration"
                ));
            }
            let key_var = provider_field(&overrides, name, "env_key").ok_or_else(|| {
                format!("the model provider `{name}` reads no key variable (`env_key`)")
            })?;
            let value = toml::Value::String(brokered_url.clone());
            let args = vec![
                "-c".to_owned(),
                format!("model_providers.{name}.base_url={value}"),
            ];
            (base, key_var.clone(), args, vec![key_var])
        }
        None => {
            let key_var = ["OPENAI_API_KEY", "CODEX_API_KEY"]
                .into_iter()
                .find(|k| input.set(k).is_some())
                .ok_or_else(|| {
                    "none of OPENAI_API_KEY, CODEX_API_KEY is set: the CLI uses its own \
                     login, kept in its home"
                        .to_owned()
                })?;
            let base = overrides
                .iter()
                .rev()
                .find(|(k, _)| k == "openai_base_url")
                .and_then(|(_, v)| v.as_str().map(str::to_owned))
                .or_else(|| input.set("OPENAI_BASE_URL"))
                .unwrap_or_else(|| "https://api.openai.com/v1".to_owned());
            let value = toml::Value::String(brokered_url.clone());
            let args = vec!["-c".to_owned(), format!("openai_base_url={value}")];
            let withhold = vec!["OPENAI_API_KEY".to_owned(), "CODEX_API_KEY".to_owned()];
            (base, key_var.to_owned(), args, withhold)
        }
    };
    let key = input
        .set(&key_var)
        .ok_or_else(|| format!("{key_var} is not set"))?;
    let upstream_base = upstream_url(&upstream).ok_or_else(|| {
        format!("the model provider's base URL `{upstream}` is not an http(s) URL")
    })?;
    let mut env = BTreeMap::from([(key_var.clone(), PLACEHOLDER_KEY.to_owned())]);
    if chosen.is_none() {
        env.insert("OPENAI_BASE_URL".to_owned(), brokered_url);
    }
    withhold.dedup();
    Ok(Brokering {
        brokered: vec![input.brokered(
            BROKER_PREFIX.to_owned(),
            upstream_base,
            KeyHeader::Bearer,
            key,
        )],
        withhold,
        env,
        args,
        ..Brokering::default()
    })
}

/// The model provider chosen by `-c model_provider=<name>` in `args`, when it is one the
/// same `args` define (`-c model_providers.<name>=…` or `.env_key=…`).
fn custom_model_provider(args: &[String]) -> Option<CustomModelProvider> {
    let overrides = config_overrides(args);
    let name = overrides
        .iter()
        .rev()
        .find(|(k, _)| k == "model_provider")
        .and_then(|(_, v)| v.as_str())?
        .to_owned();
    let table_key = format!("model_providers.{name}");
    let env_key_key = format!("{table_key}.env_key");
    let mut defined = false;
    let mut env_key = None;
    for (key, value) in &overrides {
        if *key == table_key {
            defined = true;
            env_key = value
                .get("env_key")
                .and_then(toml::Value::as_str)
                .map(str::to_owned);
        } else if *key == env_key_key {
            defined = true;
            env_key = value.as_str().map(str::to_owned);
        } else if key.starts_with(&format!("{table_key}.")) {
            defined = true;
        }
    }
    defined.then_some(CustomModelProvider { name, env_key })
}

/// The variables that carry MCP servers' header values: `<prefix><n>`. The pinned Codex
/// passes its whole environment on to its shell commands, `TOKEN` names included: these
/// are kept out by `shell_environment_policy.exclude` (see `mcp_overrides`).
const HEADER_VAR_PREFIX: &str = "AGENTRY_MCP_HEADER_TOKEN_";

/// `-c mcp_servers.<name>.<key>=<toml>` overrides for the agent's MCP servers, and the
/// variables the CLI reads their values from: its HTTP servers' header values and its
/// stdio servers' `env`. None of these values is on the command line, which every local
/// user can read. A stdio server's variable travels under its own name, which must not be
/// one the CLI itself is given (`taken`), nor have another value for another server.
/// None of these variables reaches the CLI's shell commands, nor do `credentials` (the
/// variables of the CLI's model key).
fn mcp_overrides(
    servers: &BTreeMap<String, Value>,
    taken: impl Fn(&str) -> bool,
    credentials: &[String],
) -> Result<(Vec<String>, crate::domain::SecretEnv), ProviderError> {
    fn quoted(s: &str) -> String {
        toml::Value::String(s.to_owned()).to_string()
    }
    fn inline(pairs: &[(String, String)]) -> String {
        let body: Vec<String> = pairs
            .iter()
            .map(|(k, v)| format!("{} = {}", quoted(k), quoted(v)))
            .collect();
        format!("{{ {} }}", body.join(", "))
    }
    let mut out = Vec::new();
    let mut env = crate::domain::SecretEnv::new();
    let mut header_vars = 0;
    for (name, server) in servers {
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(ProviderError::Protocol(format!(
                "MCP server name `{name}` cannot be passed to Codex (use letters, digits, `_` and `-`)"
            )));
        }
        let mut set = |key: &str, value: String| {
            out.push("-c".to_owned());
            out.push(format!("mcp_servers.{name}.{key}={value}"));
        };
        match server.get("type").and_then(Value::as_str) {
            Some("http" | "sse") => {
                let Some(url) = server.get("url").and_then(Value::as_str) else {
                    return Err(ProviderError::Protocol(format!(
                        "MCP server `{name}` has no url"
                    )));
                };
                set("url", quoted(url));
                // Header values (tokens: agentry's own server's among them) travel in
                // the environment, never on the command line every local user can read:
                // Codex reads each from the variable `env_http_headers` names.
                let headers = mcp::pairs(server.get("headers"));
                if !headers.is_empty() {
                    let mut named = Vec::with_capacity(headers.len());
                    for (header, value) in headers {
                        let var = format!("{HEADER_VAR_PREFIX}{header_vars}");
                        header_vars += 1;
                        env.insert(var.clone(), crate::domain::SecretValue::new(value));
                        named.push((header, var));
                    }
                    set("env_http_headers", inline(&named));
                }
            }
            None | Some("stdio" | "local") => {
                let argv = mcp::argv(server);
                let Some((command, args)) = argv.split_first() else {
                    return Err(ProviderError::Protocol(format!(
                        "MCP server `{name}` has no command"
                    )));
                };
                set("command", quoted(command));
                if !args.is_empty() {
                    let list: Vec<String> = args.iter().map(|a| quoted(a)).collect();
                    set("args", format!("[{}]", list.join(", ")));
                }
                // Codex hands the server each variable `env_vars` names from its own
                // environment.
                let vars = mcp::pairs(server.get("env"));
                if !vars.is_empty() {
                    let mut names = Vec::with_capacity(vars.len());
                    for (var, value) in vars {
                        if taken(&var) {
                            return Err(ProviderError::Protocol(format!(
                                "MCP server `{name}`: its variable `{var}` is one Codex itself is given or reads, so it cannot be passed on to the server"
                            )));
                        }
                        if env.get(&var).is_some_and(|v| v.expose() != value) {
                            return Err(ProviderError::Protocol(format!(
                                "MCP server `{name}`: its variable `{var}` has another value for another server, and Codex passes one environment on to all"
                            )));
                        }
                        names.push(quoted(&var));
                        env.insert(var, crate::domain::SecretValue::new(value));
                    }
                    set("env_vars", format!("[{}]", names.join(", ")));
                }
            }
            Some(other) => {
                return Err(ProviderError::Protocol(format!(
                    "MCP server `{name}` has a type Codex does not take: {other}"
                )));
            }
        }
    }
    // Codex's shell commands inherit its environment: the MCP servers' variables and the
    // model key's are the CLI's alone.
    let mut names: Vec<String> = Vec::new();
    for var in credentials.iter().chain(env.keys()) {
        if !names.contains(&quoted(var)) {
            names.push(quoted(var));
        }
    }
    if !names.is_empty() {
        out.push("-c".to_owned());
        out.push(format!(
            "shell_environment_policy.exclude=[{}]",
            names.join(", ")
        ));
    }
    Ok((out, env))
}

// ---------------------------------------------------------------------------------------
// Starting a thread
// ---------------------------------------------------------------------------------------

struct Thread {
    id: String,
    path: Option<String>,
    model: Option<String>,
    resumed: bool,
}

impl Thread {
    fn persistence(&self) -> Value {
        let mut handle = json!({ "thread_id": self.id });
        if let Some(path) = &self.path {
            handle["path"] = json!(path);
        }
        handle
    }
}

async fn open_thread(
    peer: &Peer,
    spec: &SessionSpec,
    mode: &str,
    confined: bool,
) -> Result<Thread, RpcError> {
    initialize(peer, START_TIMEOUT).await?;
    let (approval, sandbox, _) = policy(mode, confined).expect("a checked mode");
    let mut params = json!({
        "cwd": spec.cwd,
        "approvalPolicy": approval,
        "sandbox": sandbox,
    });
    if let Some(model) = &spec.model {
        params["model"] = json!(model);
    }
    let resume = spec
        .resume
        .as_ref()
        .and_then(|r| r.get("thread_id"))
        .and_then(Value::as_str);
    let (method, resumed) = match resume {
        Some(thread_id) => {
            params["threadId"] = json!(thread_id);
            ("thread/resume", true)
        }
        None => {
            if let Some(prompt) = spec.system_prompt.as_ref().filter(|p| !p.is_empty()) {
                params["developerInstructions"] = json!(prompt);
            }
            ("thread/start", false)
        }
    };
    let opened = peer.request(method, params, START_TIMEOUT).await?;
    let thread = opened.get("thread").unwrap_or(&Value::Null);
    let Some(id) = thread.get("id").and_then(Value::as_str) else {
        return Err(RpcError::Remote {
            method: method.to_owned(),
            code: 0,
            message: "the answer names no thread".to_owned(),
            data: None,
        });
    };
    Ok(Thread {
        id: id.to_owned(),
        path: thread
            .get("path")
            .and_then(Value::as_str)
            .map(str::to_owned),
        model: opened
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| spec.model.clone()),
        resumed,
    })
}

// ---------------------------------------------------------------------------------------
// Shared state, dispatch and supervision
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct TurnState {
    /// A `turn/start` was sent and its turn has not completed.
    active: bool,
    /// Codex's id of the running turn, once known.
    turn_id: Option<String>,
    /// An interrupt was asked for this turn.
    interrupted: bool,
    /// The interrupt is still to be sent (the turn id was not known yet).
    interrupt_unsent: bool,
}

struct Shared {
    events: Emitter,
    peer: Peer,
    turn: Mutex<TurnState>,
    /// Approval requests waiting for a person, by Codex's request id: dropping the
    /// sender withdraws the wait (Codex resolved the request itself).
    asks: Mutex<HashMap<String, oneshot::Sender<()>>>,
    /// Bumped by `interrupt`: every approval waiting then is answered `cancel`.
    interrupt_epoch: watch::Sender<u64>,
    stderr: StderrTail,
}

impl Shared {
    /// Learned the running turn's id: send an interrupt that was waiting for it.
    fn turn_known(self: &Arc<Self>, thread_id: Option<&str>, turn_id: &str) {
        let send = {
            let mut turn = lock(&self.turn);
            if !turn.active {
                return;
            }
            turn.turn_id.get_or_insert_with(|| turn_id.to_owned());
            std::mem::take(&mut turn.interrupt_unsent)
        };
        if send && let Some(thread_id) = thread_id {
            self.send_interrupt(thread_id.to_owned(), turn_id.to_owned());
        }
    }

    fn send_interrupt(self: &Arc<Self>, thread_id: String, turn_id: String) {
        let peer = self.peer.clone();
        tokio::spawn(async move {
            let params = json!({ "threadId": thread_id, "turnId": turn_id });
            if let Err(e) = peer
                .request("turn/interrupt", params, INTERRUPT_TIMEOUT)
                .await
            {
                tracing::debug!(error = %e, "turn/interrupt failed");
            }
        });
    }
}

/// Handle Codex's messages in order until its output ends.
async fn dispatch(mut incoming: mpsc::Receiver<Incoming>, shared: Arc<Shared>) {
    let mut mapper = Mapper::default();
    let mut thread_id: Option<String> = None;
    while let Some(message) = incoming.recv().await {
        let mapped = match message {
            Incoming::Notification { method, params } => {
                if thread_id.is_none()
                    && let Some(id) = params.get("threadId").and_then(Value::as_str)
                {
                    thread_id = Some(id.to_owned());
                }
                mapper.notification(&method, &params)
            }
            Incoming::Request { id, method, params } => mapper.request(id, &method, &params),
            Incoming::Malformed { error } => {
                tracing::warn!(%error, "unusable output from Codex");
                vec![Mapped::Event(ProviderEvent::Error {
                    message: error,
                    code: Some("provider_protocol".to_owned()),
                })]
            }
        };
        for m in mapped {
            handle(&shared, thread_id.as_deref(), m).await;
        }
    }
}

async fn handle(shared: &Arc<Shared>, thread_id: Option<&str>, mapped: Mapped) {
    match mapped {
        Mapped::Event(event) => {
            if matches!(event, ProviderEvent::TurnEnded { .. }) {
                *lock(&shared.turn) = TurnState::default();
            }
            shared.events.emit(event).await;
        }
        Mapped::TurnStarted { turn_id } => shared.turn_known(thread_id, &turn_id),
        Mapped::Refuse { id, message } => {
            tracing::debug!(%id, %message, "refusing a Codex request");
            let _ = shared.peer.respond_error(&id, -32601, &message).await;
        }
        Mapped::Resolved { id } => {
            let key = id.to_string();
            if lock(&shared.asks).remove(&key).is_some() {
                shared
                    .events
                    .emit(ProviderEvent::PermissionWithdrawn {
                        provider_request_id: key,
                    })
                    .await;
            }
        }
        Mapped::Ask { id, ask } => {
            if lock(&shared.turn).interrupted {
                let _ = shared.peer.respond(&id, decision_reply(None)).await;
                return;
            }
            let key = id.to_string();
            let (withdraw_tx, withdrawn) = oneshot::channel::<()>();
            lock(&shared.asks).insert(key.clone(), withdraw_tx);
            let mut epoch = shared.interrupt_epoch.subscribe();
            let asked_at = *epoch.borrow_and_update();
            let decision = shared.events.ask(key.clone(), ask).await;
            let shared = shared.clone();
            tokio::spawn(async move {
                let chosen = tokio::select! {
                    decision = decision => match decision {
                        Ok(PermissionDecision::Selected { option_id, .. }) => Some(option_id),
                        Ok(PermissionDecision::Cancelled) | Err(_) => None,
                    },
                    _ = epoch.wait_for(|now| *now != asked_at) => None,
                    // Codex resolved it itself: nobody waits for an answer.
                    _ = withdrawn => return,
                };
                if lock(&shared.asks).remove(&key).is_none() {
                    return;
                }
                let _ = respond_to(&shared.peer, &id, chosen.as_deref()).await;
            });
        }
    }
}

async fn respond_to(peer: &Peer, id: &RequestId, option: Option<&str>) -> Result<(), RpcError> {
    peer.respond(id, decision_reply(option)).await
}

/// Own the process: wait for it to end or for `close`, stop it, let the dispatcher
/// handle what it wrote, then report the end (to `done`, and as `Exited` if the session
/// was handed out).
async fn supervise(
    mut child: ManagedChild,
    stderr_task: StderrReader,
    dispatcher: JoinHandle<()>,
    shared: Arc<Shared>,
    signals: StopSignals,
) {
    // The dispatcher reads the output; it is waited for once the process is gone.
    let ending = watch(
        &mut child,
        std::future::pending(),
        Duration::ZERO,
        signals.close,
    )
    .await;
    // Whatever is left of the group goes now; its output ends with it.
    let reaped = drain(dispatcher, DRAIN_AFTER_EXIT);
    Exit::new("codex", &shared.events, &shared.stderr)
        .report(
            child,
            ending,
            vec![stderr_task],
            signals.report,
            Duration::ZERO,
            reaped,
        )
        .await;
}

// ---------------------------------------------------------------------------------------
// The live session
// ---------------------------------------------------------------------------------------

struct CodexSession {
    thread_id: String,
    shared: Arc<Shared>,
    mode: String,
    /// Inside agentry's sandbox (see `policy`).
    confined: bool,
    model: Option<String>,
    /// The mode changed since the last turn started: the next one carries the policy.
    unsent_policy: bool,
    unsent_model: bool,
    stopper: Stopper,
}

#[async_trait]
impl ProviderSession for CodexSession {
    async fn prompt(&mut self, input: TurnInput) -> Result<(), ProviderError> {
        if self.shared.peer.is_closed() {
            return Err(ProviderError::Gone);
        }
        {
            let mut turn = lock(&self.shared.turn);
            if turn.active {
                return Err(ProviderError::Protocol(
                    "a turn is already running".to_owned(),
                ));
            }
            *turn = TurnState {
                active: true,
                ..TurnState::default()
            };
        }
        let mut params = json!({
            "threadId": self.thread_id,
            "input": [{"type": "text", "text": input.text, "text_elements": []}],
        });
        if self.unsent_policy {
            let (approval, _, sandbox) = policy(&self.mode, self.confined).expect("a checked mode");
            params["approvalPolicy"] = json!(approval);
            params["sandboxPolicy"] = sandbox;
        }
        if self.unsent_model
            && let Some(model) = &self.model
        {
            params["model"] = json!(model);
        }
        // Sent without waiting: the answer (the turn's id, or why it did not start) is
        // handled when it comes, so nothing here waits behind unread events.
        let pending = match self.shared.peer.send_request("turn/start", params).await {
            Ok(pending) => pending,
            Err(e) => {
                *lock(&self.shared.turn) = TurnState::default();
                return Err(match e {
                    RpcError::Closed => ProviderError::Gone,
                    other => ProviderError::Protocol(other.to_string()),
                });
            }
        };
        self.unsent_policy = false;
        self.unsent_model = false;
        let shared = self.shared.clone();
        let thread_id = self.thread_id.clone();
        tokio::spawn(async move {
            match pending.result().await {
                Ok(answer) => {
                    if let Some(turn_id) = answer.pointer("/turn/id").and_then(Value::as_str) {
                        shared.turn_known(Some(&thread_id), turn_id);
                    }
                }
                Err(RpcError::Closed) => {}
                Err(e) => {
                    let active = std::mem::take(&mut *lock(&shared.turn)).active;
                    if active {
                        shared
                            .events
                            .emit(ProviderEvent::TurnEnded {
                                outcome: TurnOutcome::Failed,
                                error: Some(e.to_string()),
                                usage: None,
                            })
                            .await;
                    }
                }
            }
        });
        Ok(())
    }

    async fn interrupt(&mut self) -> Result<(), ProviderError> {
        let turn_id = {
            let mut turn = lock(&self.shared.turn);
            if !turn.active {
                return Ok(());
            }
            turn.interrupted = true;
            if turn.turn_id.is_none() {
                turn.interrupt_unsent = true;
            }
            turn.turn_id.clone()
        };
        // Approvals still waiting are answered `cancel`.
        self.shared.interrupt_epoch.send_modify(|e| *e += 1);
        if let Some(turn_id) = turn_id {
            self.shared.send_interrupt(self.thread_id.clone(), turn_id);
        }
        Ok(())
    }

    async fn set_mode(&mut self, mode: &str) -> Result<(), ProviderError> {
        if policy(mode, false).is_none() {
            return Err(ProviderError::Protocol(format!(
                "unknown Codex mode `{mode}` (known: read-only, auto, full-access)"
            )));
        }
        if self.shared.events.mode_changed(&mut self.mode, mode).await {
            self.unsent_policy = true;
        }
        Ok(())
    }

    async fn set_model(&mut self, model: &str) -> Result<(), ProviderError> {
        if model.trim().is_empty() {
            return Err(ProviderError::Protocol(
                "the model name is empty".to_owned(),
            ));
        }
        if self
            .shared
            .events
            .model_changed(&mut self.model, model)
            .await
        {
            self.unsent_model = true;
        }
        Ok(())
    }

    async fn close(mut self: Box<Self>) {
        self.stopper.stop().await;
    }
}

#[cfg(test)]
mod tests;
