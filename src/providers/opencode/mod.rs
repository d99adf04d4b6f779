//! The `opencode` provider: OpenCode's own HTTP server (`opencode serve`), REST for
//! commands and server-sent events (`GET /event`) for what happens.
//!
//! One server per agent session, on a free 127.0.0.1 port picked here, with a random
//! password (Basic auth on every call) and its whole configuration in
//! `OPENCODE_CONFIG_CONTENT`. One process per session keeps teams and workspaces apart
//! and gives a session's end a process to stop; sessions survive it in OpenCode's own
//! store, so a new server resumes one by its id. The process is in the ledger from its
//! spawn: a start timeout, an early exit and a close all stop its group.
//!
//! Tasks: a dispatcher reads the event stream in order, maps the session's events
//! (`mapping`) and hands them to the sink; a supervisor owns the process and sends
//! `Exited` last.

mod mapping;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rand::Rng;
use serde_json::{Value, json};
use tokio::sync::{Notify, oneshot, watch};
use tokio::task::JoinHandle;

pub use mapping::{Ask, Mapped, Mapper, reply_word, tool_kind};

use super::adapter::*;
use super::broker::{
    BrokerInput, Brokering, Credential, JsonSet, KeyHeader, PLACEHOLDER_KEY, upstream_url,
};
use super::mcp;
use super::supervise::{Ending, Exit, drain, tail_suffix};
use crate::domain::SecretValue;
use crate::event_stream::{Event, Parser};
use crate::process::output::{StderrReader, StderrTail, describe_exit};
use crate::process::{ManagedChild, STOP_GRACE, lock};

/// How long the server may take to answer its health route and open the session (a
/// first start in a fresh home installs a plugin).
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// One health request: the route accepts connections before the server is ready and can
/// then hang for half a minute, so each try is short.
const HEALTH_TRY: Duration = Duration::from_secs(2);
const HEALTH_PAUSE: Duration = Duration::from_millis(200);
/// One REST call once the server is up.
const CALL_TIMEOUT: Duration = Duration::from_secs(15);
/// After the process is gone, how long the rest of its events may take to be handled.
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(1);
/// When the event stream ends, how long the process has to show that it died.
const EXIT_AFTER_LOST: Duration = Duration::from_millis(500);
/// The user name of OpenCode's Basic auth (its default).
const USER: &str = "opencode";

const PASS_ENV: &[&str] = &[
    "ANTHROPIC_API_KEY",
    "OPENAI_API_KEY",
    "OPENROUTER_API_KEY",
    "GOOGLE_GENERATIVE_AI_API_KEY",
    "OPENCODE_API_KEY",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "XDG_CACHE_HOME",
];

/// The built-in descriptor.
pub fn builtin() -> Builtin {
    Builtin {
        id: "opencode",
        label: "OpenCode",
        program: "opencode",
        pass_env: PASS_ENV,
        // No model catalog download, no self-update, no LSP downloads, and never a
        // project's own `opencode.json` (the configuration is agentry's).
        env: &[
            ("OPENCODE_DISABLE_MODELS_FETCH", "1"),
            ("OPENCODE_DISABLE_AUTOUPDATE", "1"),
            ("OPENCODE_DISABLE_LSP_DOWNLOAD", "1"),
            ("OPENCODE_DISABLE_PROJECT_CONFIG", "1"),
        ],
        credential: Credential::Configured(broker),
        modes: MODES,
        default_mode: "build",
        build: |cfg| Arc::new(OpenCodeProvider::new(cfg)),
    }
}

#[rustfmt::skip]
const MODES: &[ModeRow] = &[
    ("build", "Build", "OpenCode's build agent; asks before editing files and running commands", false),
    ("plan", "Plan", "OpenCode's plan agent; edits nothing and asks before running commands", false),
    ("full-access", "Full access", "OpenCode's build agent; edits and runs commands without asking", true),
];

/// A mode as the OpenCode agent that runs its prompts, and whether agentry answers
/// OpenCode's permission requests itself (`allow` once) instead of asking a person.
///
/// OpenCode always asks for `edit` and `bash` (the configuration says `ask`): its
/// configuration is read once per process, and a session's own permission rules
/// (`PATCH /session/{id}`) were seen lost to OpenCode's own write of the session at the
/// end of a turn. Answering in the adapter makes a live mode switch work both ways.
fn policy(mode: &str) -> Option<(&'static str, bool)> {
    match mode {
        "build" => Some(("build", false)),
        "plan" => Some(("plan", false)),
        "full-access" => Some(("build", true)),
        _ => None,
    }
}

pub struct OpenCodeProvider {
    cfg: CliConfig,
    start_timeout: Duration,
}

impl OpenCodeProvider {
    pub fn new(cfg: CliConfig) -> Self {
        Self {
            cfg,
            start_timeout: START_TIMEOUT,
        }
    }

    fn mode_of(&self, requested: Option<&str>) -> Result<String, ProviderError> {
        let mode = self.cfg.mode_or_default(requested, "build");
        if policy(&mode).is_none() {
            return Err(unknown_mode(&mode));
        }
        Ok(mode)
    }

    /// The user's `OPENCODE_CONFIG_CONTENT` (from the provider's `env`), with what
    /// agentry decides set over it.
    fn config(&self, model: Option<&str>) -> Result<Value, ProviderError> {
        let mut config = match self.cfg.env.get("OPENCODE_CONFIG_CONTENT") {
            Some(text) if !text.trim().is_empty() => serde_json::from_str::<Value>(text)
                .ok()
                .filter(Value::is_object)
                .ok_or_else(|| {
                    ProviderError::Protocol(
                        "OPENCODE_CONFIG_CONTENT in the provider's env is not a JSON object"
                            .to_owned(),
                    )
                })?,
            _ => json!({}),
        };
        if let Some(model) = model {
            config["model"] = json!(model);
        }
        config["autoupdate"] = json!(false);
        config["share"] = json!("disabled");
        if !config["permission"].is_object() {
            config["permission"] = json!({});
        }
        for key in ["edit", "bash"] {
            config["permission"][key] = json!("ask");
        }
        // agentry shows no session titles: no model call to write one.
        if !config["agent"].is_object() {
            config["agent"] = json!({});
        }
        if !config["agent"]["title"].is_object() {
            config["agent"]["title"] = json!({});
        }
        config["agent"]["title"]["disable"] = json!(true);
        // The plan agent edits nothing, whatever the global `edit` above says.
        if !config["agent"]["plan"].is_object() {
            config["agent"]["plan"] = json!({});
        }
        if !config["agent"]["plan"]["permission"].is_object() {
            config["agent"]["plan"]["permission"] = json!({});
        }
        config["agent"]["plan"]["permission"]["edit"] = json!("deny");
        Ok(config)
    }

    /// Start `opencode serve` in `cwd` and wait until it answers.
    async fn serve(
        &self,
        launcher: &dyn ProcessLauncher,
        cwd: PathBuf,
        config: &Value,
    ) -> Result<Server, ProviderError> {
        let port = free_port()?;
        let password = hex::encode(rand::rng().random::<[u8; 24]>());
        let protocol = [
            "serve".to_owned(),
            "--hostname".to_owned(),
            "127.0.0.1".to_owned(),
            "--port".to_owned(),
            port.to_string(),
        ];
        let mut command = self.cfg.command(&protocol, cwd)?;
        command
            .env
            .insert("OPENCODE_CONFIG_CONTENT".to_owned(), config.to_string());
        command
            .env
            .insert("OPENCODE_SERVER_USERNAME".to_owned(), USER.to_owned());
        command.secret_env = BTreeMap::from([(
            "OPENCODE_SERVER_PASSWORD".to_owned(),
            SecretValue::new(password.clone()),
        )]);
        command.serves = Some(port);
        let mut child = launcher.launch(command).await?;
        let Some((stdin, stdout, stderr)) = child.take_stdio().await else {
            return Err(ProviderError::Protocol(
                "the OpenCode process has no piped stdio".to_owned(),
            ));
        };
        // It reads nothing from stdin.
        drop(stdin);
        let redactor = child.redactor();
        let (stderr, stderr_task) =
            StderrTail::capture_masked(stderr, "agentry::providers::opencode", redactor.clone());
        let (_, stdout_task) =
            StderrTail::capture_masked(stdout, "agentry::providers::opencode::stdout", redactor);
        Ok(Server {
            child,
            api: Api::new(port, password, launcher.reach(port))?,
            stderr,
            readers: vec![stderr_task, stdout_task],
        })
    }
}

/// OpenCode's built-in model providers agentry can broker: (provider id, the key variable
/// OpenCode reads, the API's base URL as OpenCode's SDK for it takes it, the key's header).
const BUILT_IN_APIS: &[(&str, &str, &str, KeyHeader)] = &[
    (
        "anthropic",
        "ANTHROPIC_API_KEY",
        "https://api.anthropic.com/v1",
        KeyHeader::Named("x-api-key"),
    ),
    (
        "openai",
        "OPENAI_API_KEY",
        "https://api.openai.com/v1",
        KeyHeader::Bearer,
    ),
    (
        "openrouter",
        "OPENROUTER_API_KEY",
        "https://openrouter.ai/api/v1",
        KeyHeader::Bearer,
    ),
    (
        "google",
        "GOOGLE_GENERATIVE_AI_API_KEY",
        "https://generativelanguage.googleapis.com/v1beta",
        KeyHeader::Named("x-goog-api-key"),
    ),
];

/// OpenCode's credentials under the egress proxy. Every model provider with a key — one
/// of `OPENCODE_CONFIG_CONTENT`'s `provider` entries with `options.apiKey` (a literal or
/// `{env:NAME}`), or a built-in one whose key variable is set — is given the brokered URL
/// `…/opencode/<provider id>` as its `options.baseURL` and the placeholder as its
/// `options.apiKey`; the proxy sends on to the configured `baseURL` (the vendor's API for
/// a built-in one) with the key in that API's header. A key it cannot place (OpenCode's
/// own service, a provider without a base URL agentry knows) keeps every key inside.
fn broker(input: &BrokerInput<'_>) -> Result<Brokering, String> {
    const VAR: &str = "OPENCODE_CONFIG_CONTENT";
    let config = match input.set(VAR) {
        Some(text) => serde_json::from_str::<Value>(&text)
            .ok()
            .filter(Value::is_object)
            .ok_or_else(|| format!("{VAR} is not a JSON object"))?,
        None => json!({}),
    };
    if input.set("OPENCODE_API_KEY").is_some() {
        return Err("OPENCODE_API_KEY is set: OpenCode's own service is not brokered".to_owned());
    }
    let empty = serde_json::Map::new();
    let providers = config["provider"].as_object().unwrap_or(&empty);
    let mut out = Brokering::default();
    let mut ids: Vec<&str> = providers.keys().map(String::as_str).collect();
    for (id, var, _, _) in BUILT_IN_APIS {
        if input.set(var).is_some() && !ids.contains(id) {
            ids.push(id);
        }
    }
    for id in ids {
        let entry = providers.get(id).unwrap_or(&Value::Null);
        let built_in = BUILT_IN_APIS.iter().find(|b| b.0 == id);
        let options = &entry["options"];
        let key = match options.get("apiKey") {
            Some(Value::String(text)) => {
                match text.strip_prefix("{env:").and_then(|t| t.strip_suffix('}')) {
                    Some(name) => {
                        out.withhold.push(name.to_owned());
                        input.set(name)
                    }
                    None => Some(text.clone()),
                }
            }
            Some(_) => return Err(format!("provider `{id}`'s apiKey is not a string")),
            None => built_in.and_then(|b| {
                out.withhold.push(b.1.to_owned());
                input.set(b.1)
            }),
        };
        let Some(key) = key.filter(|k| !k.is_empty()) else {
            // A provider without a key (a local model server) needs nothing added.
            continue;
        };
        if let Some(b) = built_in {
            out.withhold.push(b.1.to_owned());
        }
        if id.is_empty()
            || !id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        {
            return Err(format!(
                "the provider id `{id}` cannot name a brokered path (use letters, digits, `-`, `_`, `.`)"
            ));
        }
        let upstream = match options.get("baseURL").and_then(Value::as_str) {
            Some(url) => url.to_owned(),
            None => match built_in {
                Some(b) => b.2.to_owned(),
                None => {
                    return Err(format!(
                        "provider `{id}` has a key but no options.baseURL agentry could send it on to"
                    ));
                }
            },
        };
        let upstream_base = upstream_url(&upstream)
            .ok_or_else(|| format!("provider `{id}`'s baseURL is not an http(s) URL"))?;
        let header = match (entry["npm"].as_str(), built_in) {
            (Some("@ai-sdk/anthropic"), _) => KeyHeader::Named("x-api-key"),
            (Some("@ai-sdk/google"), _) => KeyHeader::Named("x-goog-api-key"),
            (Some(_), _) | (None, None) => KeyHeader::Bearer,
            (None, Some(b)) => b.3,
        };
        let prefix = format!("opencode/{id}");
        for (field, value) in [
            ("baseURL", crate::egress::brokered_base_url(&prefix)),
            ("apiKey", PLACEHOLDER_KEY.to_owned()),
        ] {
            out.json_env.push(JsonSet {
                var: VAR.to_owned(),
                path: vec!["provider".into(), id.into(), "options".into(), field.into()],
                value: json!(value),
            });
        }
        out.brokered
            .push(input.brokered(prefix, upstream_base, header, key));
    }
    if out.brokered.is_empty() {
        return Err(format!(
            "no model provider of {VAR} has a key, and none of the key variables is set: \
             the CLI uses its own login, kept in its home"
        ));
    }
    out.withhold.sort();
    out.withhold.dedup();
    Ok(out)
}

fn unknown_mode(mode: &str) -> ProviderError {
    ProviderError::Protocol(format!(
        "unknown OpenCode mode `{mode}` (known: build, plan, full-access)"
    ))
}

/// A free port on 127.0.0.1 (released for the server to take).
fn free_port() -> Result<u16, ProviderError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| ProviderError::Protocol(format!("no free port for OpenCode: {e}")))
}

/// `provider/model` as OpenCode's `{providerID, modelID}`.
fn model_ref(model: &str) -> Option<Value> {
    let (provider, model) = model.split_once('/')?;
    (!provider.is_empty() && !model.is_empty())
        .then(|| json!({"providerID": provider, "modelID": model}))
}

/// A started server before its session exists.
struct Server {
    child: ManagedChild,
    api: Api,
    stderr: StderrTail,
    readers: Vec<StderrReader>,
}

impl Server {
    /// Stop it and say why it could not be used.
    async fn abandon(mut self, why: String) -> ProviderError {
        self.child.terminate(STOP_GRACE).await;
        for r in self.readers {
            r.settle().await;
        }
        ProviderError::Protocol(format!("{why}{}", tail_suffix("output", &self.stderr)))
    }
}

// ---------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------

/// OpenCode's REST API on one server, with its credentials.
#[derive(Clone)]
struct Api {
    http: reqwest::Client,
    base: String,
    password: String,
}

impl Api {
    /// The server on loopback `port`, reached through the Unix socket `via` when it runs
    /// in a network namespace of its own.
    fn new(port: u16, password: String, via: Option<PathBuf>) -> Result<Self, ProviderError> {
        // reqwest needs a TLS provider even for plain http; the process's is ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = reqwest::Client::builder().no_proxy();
        if let Some(socket) = via {
            builder = builder.unix_socket(socket);
        }
        let http = builder
            .build()
            .map_err(|e| ProviderError::Protocol(format!("no HTTP client: {e}")))?;
        Ok(Self {
            http,
            base: format!("http://127.0.0.1:{port}"),
            password,
        })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .basic_auth(USER, Some(&self.password))
    }

    /// One call; the answer's JSON (`null` for an empty body) or why it failed.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<Value, String> {
        let mut request = self.request(method.clone(), path).timeout(timeout);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request
            .send()
            .await
            .map_err(|e| format!("{method} {path}: {e}"))?;
        let status = response.status();
        let text = response
            .text()
            .await
            .map_err(|e| format!("{method} {path}: {e}"))?;
        if !status.is_success() {
            let text: String = text.chars().take(500).collect();
            return Err(format!("{method} {path} answered {status}: {text}"));
        }
        if text.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&text).map_err(|e| format!("{method} {path}: unreadable answer: {e}"))
    }

    async fn get(&self, path: &str) -> Result<Value, String> {
        self.call(reqwest::Method::GET, path, None, CALL_TIMEOUT)
            .await
    }

    async fn post(&self, path: &str, body: &Value) -> Result<Value, String> {
        self.call(reqwest::Method::POST, path, Some(body), CALL_TIMEOUT)
            .await
    }

    /// Poll the health route (short tries) until it says healthy or the process ends.
    async fn healthy(&self, exited: &mut watch::Receiver<bool>) -> Result<(), String> {
        loop {
            if *exited.borrow() {
                return Err("OpenCode exited before it was ready".to_owned());
            }
            let tried = self
                .call(reqwest::Method::GET, "/global/health", None, HEALTH_TRY)
                .await;
            if let Ok(answer) = tried
                && answer.get("healthy").and_then(Value::as_bool) == Some(true)
            {
                return Ok(());
            }
            tokio::select! {
                _ = tokio::time::sleep(HEALTH_PAUSE) => {}
                _ = exited.changed() => {}
            }
        }
    }

    /// Open `GET /event` and read up to its first event (`server.connected`), so that
    /// nothing that happens afterwards is missed.
    async fn events(&self) -> Result<EventStream, String> {
        let response = self
            .request(reqwest::Method::GET, "/event")
            .header("accept", "text/event-stream")
            .send()
            .await
            .map_err(|e| format!("GET /event: {e}"))?;
        if !response.status().is_success() {
            return Err(format!("GET /event answered {}", response.status()));
        }
        let mut stream = EventStream::new(response);
        match tokio::time::timeout(CALL_TIMEOUT, stream.next()).await {
            Ok(Some(Ok(_))) => Ok(stream),
            Ok(Some(Err(e))) => Err(e),
            Ok(None) => Err("the event stream ended at once".to_owned()),
            Err(_) => Err("the event stream sent nothing".to_owned()),
        }
    }
}

/// OpenCode's server-sent events, one JSON object per event's `data`.
struct EventStream {
    body: reqwest::Response,
    parser: Parser,
    /// Events parsed from a chunk and not yet handed out.
    ready: VecDeque<Event>,
    too_long: bool,
}

/// The most bytes held for one event not yet complete: an event is one line, and a
/// tool's output can be large.
const MAX_EVENT: usize = 16 * 1024 * 1024;

impl EventStream {
    fn new(body: reqwest::Response) -> Self {
        Self {
            body,
            parser: Parser::new(),
            ready: VecDeque::new(),
            too_long: false,
        }
    }

    /// The next event; `None` when the stream ends.
    async fn next(&mut self) -> Option<Result<Value, String>> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                if event.data.is_empty() {
                    // An event without a payload tells nothing.
                    continue;
                }
                return Some(
                    serde_json::from_str(&event.data)
                        .map_err(|e| format!("an unreadable event from OpenCode: {e}")),
                );
            }
            if self.too_long {
                return None;
            }
            if self.parser.pending() > MAX_EVENT {
                // The rest of the stream cannot be read in step: report it once, then
                // treat the stream as ended.
                self.too_long = true;
                return Some(Err("an event from OpenCode is too long".to_owned()));
            }
            match self.body.chunk().await {
                Ok(Some(bytes)) => self.ready.extend(self.parser.push(&bytes)),
                Ok(None) => return None,
                Err(e) => return Some(Err(format!("the event stream broke: {e}"))),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The provider
// ---------------------------------------------------------------------------------------

#[async_trait]
impl Provider for OpenCodeProvider {
    fn info(&self) -> ProviderInfo {
        self.cfg.info("opencode-http")
    }

    async fn availability(&self) -> Availability {
        if let Some(why) = command_missing(&self.cfg.command) {
            return Availability::Unavailable(why);
        }
        // OpenCode takes credentials from many places (its own auth store, a provider's
        // variables, the configuration): whether they work shows on the first prompt.
        Availability::Available
    }

    /// The models of the providers OpenCode can use (`GET /config/providers`) as
    /// `provider/model`, from a server started for the probe.
    async fn models(&self, probe: &Probe) -> Result<Vec<ModelInfo>, ProviderError> {
        let config = self.config(None)?;
        let mut server = self
            .serve(probe.launcher.as_ref(), probe.cwd.clone(), &config)
            .await?;
        let (exited_tx, mut exited) = watch::channel(false);
        let listed = tokio::time::timeout(self.start_timeout, async {
            tokio::select! {
                status = server.child.wait() => {
                    let _ = exited_tx.send(true);
                    Err(describe_exit(status.ok(), None, ""))
                }
                listed = async {
                    server.api.healthy(&mut exited).await?;
                    server.api.get("/config/providers").await
                } => listed,
            }
        })
        .await;
        let default = config
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_owned);
        match listed {
            Ok(Ok(answer)) => {
                server.child.terminate(STOP_GRACE).await;
                for r in server.readers {
                    r.settle().await;
                }
                Ok(catalog(&answer, default.as_deref()))
            }
            Ok(Err(e)) => Err(server
                .abandon(format!("listing OpenCode's models failed: {e}"))
                .await),
            Err(_) => Err(server
                .abandon(format!(
                    "OpenCode did not list its models within {} s",
                    self.start_timeout.as_secs()
                ))
                .await),
        }
    }

    async fn start(&self, spec: SessionSpec, launcher: Launcher, events: EventSink) -> Started {
        let mode = self.mode_of(spec.mode.as_deref())?;
        if let Some(model) = &spec.model
            && model_ref(model).is_none()
        {
            return Err(ProviderError::Protocol(format!(
                "OpenCode names models `provider/model`, not `{model}`"
            )));
        }
        let mcp = mcp_configs(&spec.mcp_servers)?;
        let config = self.config(spec.model.as_deref())?;
        let model = spec.model.clone().or_else(|| {
            config
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_owned)
        });
        let server = self
            .serve(launcher.as_ref(), spec.cwd.clone(), &config)
            .await?;
        let pid = server.child.pid();
        let api = server.api.clone();
        let (exited_tx, mut exited) = watch::channel(false);
        let (mut stopper, signals) = Stopper::new();
        let shared = Arc::new(Shared {
            events: Emitter::new(events),
            closing: signals.report.closing.clone(),
            stderr: server.stderr.clone(),
            lost: Notify::new(),
            exited: exited_tx,
        });
        let (dispatcher_tx, dispatcher_rx) = oneshot::channel();
        tokio::spawn(supervise(
            server.child,
            server.readers,
            dispatcher_rx,
            shared.clone(),
            signals,
        ));

        let opened = tokio::time::timeout(self.start_timeout, async {
            api.healthy(&mut exited).await?;
            let stream = api.events().await?;
            let (session_id, resume_failure) =
                open_session(&api, spec.resume.as_ref()).await?;
            let resumed = spec.resume.is_some() && resume_failure.is_none();
            let mut notes = Vec::new();
            if let Some(why) = resume_failure {
                notes.push(ProviderEvent::Error {
                    message: format!(
                        "the earlier conversation could not be reopened ({why}); a new session was started"
                    ),
                    code: Some("resume_failed".to_owned()),
                });
            }
            for (name, config) in &mcp {
                let added = api
                    .post("/mcp", &json!({"name": name, "config": config}))
                    .await
                    .map_err(|e| format!("adding the MCP server `{name}` failed: {e}"))?;
                // OpenCode answers every server's status; one that failed to start leaves
                // the session usable without it.
                if let Some(error) = mcp_failure(&added, name) {
                    notes.push(ProviderEvent::Error {
                        message: format!("the MCP server `{name}` did not start: {error}"),
                        code: Some("mcp_server_failed".to_owned()),
                    });
                }
            }
            Ok::<_, String>((stream, session_id, resumed, notes))
        })
        .await;
        let failure = match opened {
            Ok(Ok((stream, session_id, resumed, notes))) => {
                let live = Arc::new(Live {
                    shared: shared.clone(),
                    api,
                    session_id: session_id.clone(),
                    mapper: Mutex::new(Mapper::new(session_id.clone())),
                    asks: Mutex::new(HashMap::new()),
                    interrupt_epoch: watch::channel(0).0,
                    unattended: AtomicBool::new(policy(&mode).expect("a checked mode").1),
                });
                let _ = dispatcher_tx.send(tokio::spawn(dispatch(stream, live.clone())));
                let info = SessionInfo {
                    provider_session_id: Some(session_id.clone()),
                    persistence: Some(json!({ "session_id": session_id })),
                    pid: Some(pid),
                    resumed,
                    current_mode: Some(mode.clone()),
                    current_model: model.clone(),
                };
                for note in notes {
                    shared.events.emit(note).await;
                }
                stopper.handed_out();
                let session = OpenCodeSession {
                    live,
                    mode,
                    model,
                    system: spec.system_prompt.filter(|p| !p.is_empty()),
                    stopper,
                };
                return Ok((Box::new(session), info));
            }
            Ok(Err(e)) => e,
            Err(_) => format!(
                "OpenCode did not start within {} s",
                self.start_timeout.as_secs_f32()
            ),
        };
        // The session never started: stop the process, no events, say why. (The
        // supervisor waits for a dispatcher until the sender is gone.)
        drop(dispatcher_tx);
        let exit = stopper.stop().await;
        Err(ProviderError::Protocol(format!("{failure} ({exit})")))
    }
}

/// The models of `GET /config/providers`, as `provider/model`.
fn catalog(answer: &Value, default: Option<&str>) -> Vec<ModelInfo> {
    let mut out = Vec::new();
    for provider in answer
        .get("providers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(provider_id) = provider.get("id").and_then(Value::as_str) else {
            continue;
        };
        let provider_name = provider
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or(provider_id);
        let Some(models) = provider.get("models").and_then(Value::as_object) else {
            continue;
        };
        for (key, model) in models {
            let model_id = model.get("id").and_then(Value::as_str).unwrap_or(key);
            let id = format!("{provider_id}/{model_id}");
            let name = model
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or(model_id);
            out.push(ModelInfo {
                is_default: default == Some(id.as_str()),
                label: format!("{provider_name}: {name}"),
                context_window: model.pointer("/limit/context").and_then(Value::as_u64),
                id,
            });
        }
    }
    out
}

/// The agent's MCP servers as OpenCode's `local` / `remote` configurations.
fn mcp_configs(servers: &BTreeMap<String, Value>) -> Result<Vec<(String, Value)>, ProviderError> {
    fn pairs(value: Option<&Value>) -> serde_json::Map<String, Value> {
        mcp::pairs(value)
            .into_iter()
            .map(|(k, v)| (k, json!(v)))
            .collect()
    }
    let mut out = Vec::new();
    for (name, server) in servers {
        let config = match server.get("type").and_then(Value::as_str) {
            Some("http" | "sse" | "remote") => {
                let Some(url) = server.get("url").and_then(Value::as_str) else {
                    return Err(ProviderError::Protocol(format!(
                        "MCP server `{name}` has no url"
                    )));
                };
                let mut config = json!({"type": "remote", "url": url});
                let headers = pairs(server.get("headers"));
                if !headers.is_empty() {
                    config["headers"] = Value::Object(headers);
                }
                config
            }
            None | Some("stdio" | "local") => {
                let argv = mcp::argv(server);
                if argv.is_empty() {
                    return Err(ProviderError::Protocol(format!(
                        "MCP server `{name}` has no command"
                    )));
                }
                let mut config = json!({"type": "local", "command": argv});
                let env = pairs(server.get("env"));
                if !env.is_empty() {
                    config["environment"] = Value::Object(env);
                }
                config
            }
            Some(other) => {
                return Err(ProviderError::Protocol(format!(
                    "MCP server `{name}` has a type OpenCode does not take: {other}"
                )));
            }
        };
        out.push((name.clone(), config));
    }
    Ok(out)
}

/// Why `POST /mcp` says the server `name` did not start, if it says so.
fn mcp_failure(answer: &Value, name: &str) -> Option<String> {
    let status = answer.get(name)?;
    (status.get("status").and_then(Value::as_str) == Some("failed")).then(|| {
        status
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("no reason given")
            .to_owned()
    })
}

/// Reopen the stored session when it still exists, else create one (answering why the
/// stored one could not be reopened).
async fn open_session(
    api: &Api,
    resume: Option<&Value>,
) -> Result<(String, Option<String>), String> {
    let stored = resume
        .and_then(|r| r.get("session_id"))
        .and_then(Value::as_str)
        .filter(|id| {
            id.starts_with("ses") && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
    let mut failure = None;
    if let Some(id) = stored {
        match api.get(&format!("/session/{id}")).await {
            Ok(_) => return Ok((id.to_owned(), None)),
            Err(e) => {
                tracing::warn!(session = id, error = %e, "the stored OpenCode session is gone; starting a new one");
                failure = Some(e);
            }
        }
    } else if resume.is_some() {
        failure = Some("the stored handle names no OpenCode session".to_owned());
    }
    let created = api.post("/session", &json!({})).await?;
    let id = created
        .get("id")
        .and_then(Value::as_str)
        .ok_or_else(|| "POST /session named no session".to_owned())?;
    Ok((id.to_owned(), failure))
}

// ---------------------------------------------------------------------------------------
// Shared state, dispatch and supervision
// ---------------------------------------------------------------------------------------

/// What the supervisor and the session share about the process.
struct Shared {
    events: Emitter,
    closing: Arc<AtomicBool>,
    stderr: StderrTail,
    /// The event stream ended while the process lives: nothing more can be followed.
    lost: Notify,
    /// Set once the process is gone.
    exited: watch::Sender<bool>,
}

/// A live session on the server.
struct Live {
    shared: Arc<Shared>,
    api: Api,
    session_id: String,
    mapper: Mutex<Mapper>,
    /// Permission requests waiting for a person, by OpenCode's id: dropping the sender
    /// withdraws the wait (OpenCode has its answer).
    asks: Mutex<HashMap<String, oneshot::Sender<()>>>,
    /// Bumped by `interrupt`: every request waiting then stops waiting.
    interrupt_epoch: watch::Sender<u64>,
    /// The mode runs unattended: requests are allowed here, nobody is asked.
    unattended: AtomicBool,
}

/// Handle the server's events in order until the stream ends.
async fn dispatch(mut stream: EventStream, live: Arc<Live>) {
    while let Some(event) = stream.next().await {
        let event = match event {
            Ok(event) => event,
            // A stream cut by the session's own close is the close, not a fault.
            Err(_) if live.shared.closing.load(Ordering::Acquire) => break,
            Err(error) => {
                tracing::warn!(%error, "unusable output from OpenCode");
                live.shared
                    .events
                    .emit(ProviderEvent::Error {
                        message: error,
                        code: Some("provider_protocol".to_owned()),
                    })
                    .await;
                continue;
            }
        };
        let mapped = lock(&live.mapper).event(&event);
        for m in mapped {
            handle(&live, m).await;
        }
    }
    if !live.shared.closing.load(Ordering::Acquire) {
        live.shared.lost.notify_one();
    }
}

async fn handle(live: &Arc<Live>, mapped: Mapped) {
    match mapped {
        Mapped::Event(event) => live.shared.events.emit(event).await,
        Mapped::Replied { request_id } => {
            if lock(&live.asks).remove(&request_id).is_some() {
                live.shared
                    .events
                    .emit(ProviderEvent::PermissionWithdrawn {
                        provider_request_id: request_id,
                    })
                    .await;
            }
        }
        Mapped::Ask { request_id, .. } if live.unattended.load(Ordering::Acquire) => {
            let live = live.clone();
            tokio::spawn(async move {
                let path = format!("/permission/{request_id}/reply");
                if let Err(e) = live.api.post(&path, &json!({"reply": "once"})).await {
                    tracing::debug!(error = %e, "allowing an OpenCode permission failed");
                }
            });
        }
        Mapped::Ask {
            request_id: id,
            ask,
        } => {
            let (withdraw_tx, withdrawn) = oneshot::channel::<()>();
            lock(&live.asks).insert(id.clone(), withdraw_tx);
            let mut epoch = live.interrupt_epoch.subscribe();
            let asked_at = *epoch.borrow_and_update();
            let decision = live.shared.events.ask(id.clone(), ask).await;
            let live = live.clone();
            tokio::spawn(async move {
                let word = tokio::select! {
                    decision = decision => reply_word(&decision.unwrap_or(PermissionDecision::Cancelled)),
                    // The abort that follows an interrupt settles the request.
                    _ = epoch.wait_for(|now| *now != asked_at) => return,
                    // OpenCode has its answer already.
                    _ = withdrawn => return,
                };
                if lock(&live.asks).remove(&id).is_none() {
                    return;
                }
                if let Err(e) = live
                    .api
                    .post(&format!("/permission/{id}/reply"), &json!({"reply": word}))
                    .await
                {
                    tracing::debug!(error = %e, "replying to an OpenCode permission failed");
                }
            });
        }
    }
}

/// Own the process: wait for it to end, for `close`, or for the event stream to be lost;
/// stop its group, let the dispatcher handle what it read, then report the end (to
/// `done`, and as `Exited` if the session was handed out).
async fn supervise(
    mut child: ManagedChild,
    readers: Vec<StderrReader>,
    dispatcher: oneshot::Receiver<JoinHandle<()>>,
    shared: Arc<Shared>,
    signals: StopSignals,
) {
    let mut ending = Ending::default();
    tokio::select! {
        waited = child.wait() => ending.status = waited.ok(),
        _ = signals.close => {}
        _ = shared.lost.notified() => {
            // The stream also ends when the process dies: then its exit is the reason.
            match tokio::time::timeout(EXIT_AFTER_LOST, child.wait()).await {
                Ok(waited) => ending.status = waited.ok(),
                Err(_) => {
                    // The process is stopped because its events can no longer be followed.
                    ending.broken = Some("the event stream from OpenCode ended".to_owned());
                    ending.lost = true;
                }
            }
        }
    }
    let _ = shared.exited.send(true);
    let reaped = async {
        if let Ok(dispatcher) = dispatcher.await {
            drain(dispatcher, DRAIN_AFTER_EXIT).await;
        }
    };
    Exit::new("opencode", &shared.events, &shared.stderr)
        .report(
            child,
            ending,
            readers,
            signals.report,
            Duration::ZERO,
            reaped,
        )
        .await;
}

// ---------------------------------------------------------------------------------------
// The live session
// ---------------------------------------------------------------------------------------

struct OpenCodeSession {
    live: Arc<Live>,
    mode: String,
    model: Option<String>,
    system: Option<String>,
    stopper: Stopper,
}

#[async_trait]
impl ProviderSession for OpenCodeSession {
    /// OpenCode names each prompt's message (`message.updated`, role user).
    fn records_user_messages(&self) -> bool {
        true
    }

    async fn prompt(&mut self, input: TurnInput) -> Result<(), ProviderError> {
        if *self.live.shared.exited.borrow() {
            return Err(ProviderError::Gone);
        }
        {
            let mut mapper = lock(&self.live.mapper);
            if mapper.is_active() {
                return Err(ProviderError::Protocol(
                    "a turn is already running".to_owned(),
                ));
            }
            mapper.begin_turn();
        }
        let (agent, _) = policy(&self.mode).expect("a checked mode");
        // OpenCode's `question` tool waits for an answer through routes this adapter does
        // not serve (`/question`); without it the model asks in its reply instead.
        let mut body = json!({
            "parts": [{"type": "text", "text": input.text}],
            "agent": agent,
            "tools": {"question": false},
        });
        if let Some(model) = self.model.as_deref().and_then(model_ref) {
            body["model"] = model;
        }
        if let Some(system) = &self.system {
            body["system"] = json!(system);
        }
        let path = format!("/session/{}/prompt_async", self.live.session_id);
        if let Err(e) = self.live.api.post(&path, &body).await {
            lock(&self.live.mapper).abandon_turn();
            if *self.live.shared.exited.borrow() {
                return Err(ProviderError::Gone);
            }
            return Err(ProviderError::Protocol(e));
        }
        Ok(())
    }

    async fn interrupt(&mut self) -> Result<(), ProviderError> {
        {
            let mut mapper = lock(&self.live.mapper);
            if !mapper.is_active() {
                return Ok(());
            }
            mapper.interrupt();
        }
        // Requests still waiting stop waiting: the abort settles them in OpenCode.
        self.live.interrupt_epoch.send_modify(|e| *e += 1);
        let live = self.live.clone();
        tokio::spawn(async move {
            let path = format!("/session/{}/abort", live.session_id);
            if let Err(e) = live.api.post(&path, &json!({})).await {
                tracing::debug!(error = %e, "aborting the OpenCode session failed");
            }
        });
        Ok(())
    }

    async fn set_mode(&mut self, mode: &str) -> Result<(), ProviderError> {
        let Some((_, unattended)) = policy(mode) else {
            return Err(unknown_mode(mode));
        };
        self.live.unattended.store(unattended, Ordering::Release);
        self.live
            .shared
            .events
            .mode_changed(&mut self.mode, mode)
            .await;
        Ok(())
    }

    async fn set_model(&mut self, model: &str) -> Result<(), ProviderError> {
        if model_ref(model).is_none() {
            return Err(ProviderError::Protocol(format!(
                "OpenCode names models `provider/model`, not `{model}`"
            )));
        }
        self.live
            .shared
            .events
            .model_changed(&mut self.model, model)
            .await;
        Ok(())
    }

    async fn close(mut self: Box<Self>) {
        self.stopper.stop().await;
    }
}

#[cfg(test)]
mod tests;
