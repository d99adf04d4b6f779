//! Starting a session: the handshake (initialize, open or reopen, authenticate, mode and
//! model), the tasks that move the agent's output, and the process' supervisor.

use super::*;
use crate::providers::emitter::Reporting;
use crate::providers::supervise::{Exit, watch};

/// What the handshake offers and may do, from the provider's configuration.
pub(super) struct Handshake {
    serve_reads: bool,
    auth_method: Option<String>,
    /// Where the modes and models the agent announces are kept.
    announced: Arc<Mutex<Announced>>,
    /// The session's model is given on the command line (`model_flag`): the model an
    /// answer calls current is not taken as the session's.
    model_flagged: bool,
}

/// What the handshake established.
pub(super) struct Established {
    connection: acp::v1::ConnectionTo<acp::Agent>,
    session_id: String,
    resumed: bool,
}

/// Turn the `mcp_servers` of a spec into ACP declarations, skipping what cannot be sent.
pub(super) fn mcp_servers(
    servers: &BTreeMap<String, Value>,
    caps: &proto::McpCapabilities,
) -> Vec<proto::McpServer> {
    use crate::providers::mcp::{self, pairs};

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
                // `command` is a program, or a whole argv.
                let mut argv = mcp::command(server).into_iter();
                let command = argv.next().unwrap_or_default();
                if command.is_empty() {
                    tracing::warn!(server = %name, "MCP server without a command; skipped");
                    continue;
                }
                let args: Vec<String> = argv.chain(mcp::args(server)).collect();
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

pub(super) fn request_error(what: &str, e: &acp::Error) -> ProviderError {
    if acp::is_incoming_transport_closed(e) || acp::is_connection_terminated(e) {
        ProviderError::Gone
    } else {
        ProviderError::Protocol(format!("{what}: {}", e.message))
    }
}

/// Initialize the agent and open (or reopen) the session.
pub(super) async fn establish(
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
            with_auth(connection, handshake, || {
                load_session(
                    connection,
                    shared,
                    handshake,
                    &id,
                    spec,
                    &servers,
                    &system_prompt,
                )
            })
            .await
            .map_err(|e| e.message)
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
            let created = with_auth(connection, handshake, || {
                connection.send_request(request.clone()).block_task()
            })
            .await;
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

pub(super) type Reopened = (
    Option<proto::SessionModeState>,
    Option<Vec<proto::SessionConfigOption>>,
);

/// Keep what a session answer announces; its current model is the session's when the
/// model is not given on the command line nor a config option.
pub(super) fn announce(shared: &Shared, handshake: &Handshake, answer: &Value) {
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
pub(super) async fn load_session(
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

/// Make a request with `request`; when the agent answers that it wants authentication
/// first, authenticate (when a method is configured) and make it once more.
async fn with_auth<T, F>(
    connection: &acp::v1::ConnectionTo<acp::Agent>,
    handshake: &Handshake,
    request: impl Fn() -> F,
) -> Result<T, acp::Error>
where
    F: Future<Output = Result<T, acp::Error>>,
{
    let first = request().await;
    if matches!(&first, Err(e) if e.code == acp::ErrorCode::AUTH_REQUIRED)
        && authenticate(connection, handshake).await
    {
        return request().await;
    }
    first
}

/// `authenticate` with the configured method, if there is one; whether it succeeded.
pub(super) async fn authenticate(
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
pub(super) async fn change_mode(
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
            let changes = set_option(connection, shared, session_id, option, value).await?;
            shared.report_model(changes.model).await;
        }
    } else {
        match option {
            Some(option) => {
                let changes = set_option(connection, shared, session_id, option, mode).await?;
                shared.report_model(changes.model).await;
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
    shared
        .report_if_new(Setting::Mode, reports_before, mode)
        .await;
    Ok(())
}

/// Set the model through the agent's model config option. Emits `ModelChanged` unless
/// the agent already reported the change itself.
pub(super) async fn change_model(
    connection: &acp::v1::ConnectionTo<acp::Agent>,
    shared: &Shared,
    session_id: &str,
    option: &str,
    model: &str,
) -> Result<(), ProviderError> {
    let reports_before = lock(&shared.config).model_reports;
    let value = proto::SessionConfigOptionValue::value_id(model.to_owned());
    let changes = set_option(connection, shared, session_id, option.to_owned(), value).await?;
    if let Some(mode) = changes.mode {
        shared
            .report_change(ProviderEvent::ModeChanged { mode })
            .await;
    }
    shared
        .report_if_new(Setting::Model, reports_before, model)
        .await;
    Ok(())
}

/// Set the agent's config option `option` to `value` and take in the options it answers
/// with: what they changed.
async fn set_option(
    connection: &acp::v1::ConnectionTo<acp::Agent>,
    shared: &Shared,
    session_id: &str,
    option: String,
    value: impl Into<proto::SessionConfigOptionValue>,
) -> Result<ConfigChanges, ProviderError> {
    let response = connection
        .send_request(proto::SetSessionConfigOptionRequest::new(
            session_id.to_owned(),
            option,
            value,
        ))
        .block_task()
        .await
        .map_err(|e| request_error("session/set_config_option failed", &e))?;
    Ok(lock(&shared.config).absorb_options(&response.config_options))
}

/// `session/set_model`, outside the current schema but still answered by agents that
/// report no model config option (Gemini).
pub(super) async fn set_model_request(
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

pub(super) async fn start_session(
    cfg: &AcpProviderConfig,
    presets: Arc<[ModePreset]>,
    announced: Arc<Mutex<Announced>>,
    spec: SessionSpec,
    launcher: Launcher,
    events: EventSink,
) -> Started {
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
            env: cfg.env.clone(),
            pass_env: cfg.pass_env.clone(),
            ..CommandSpec::new(program.clone(), args, spec.cwd.clone())
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
        stderr: stderr_ring,
        update_credits,
    });

    let (established_tx, established_rx) = oneshot::channel::<Result<Established, ProviderError>>();
    let (mut stopper, StopSignals { close, report }) = Stopper::new();
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
                    _ = close => {}
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

    tokio::spawn(supervise(
        connection,
        child,
        stderr_task,
        shared.clone(),
        Supervision { report, pump },
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
            stopper.handed_out();
            let session = AcpSession {
                session_id: established.session_id,
                connection: established.connection,
                shared,
                stopper,
            };
            return Ok((Box::new(session), info));
        }
        Ok(Err(e)) => Some(e),
        Err(_) => None,
    };
    // The session never started: no events (stopping it before it is handed out says
    // so), stop the process, explain why.
    shared.events.close().await;
    let exit = stopper.stop().await;
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
pub(super) async fn handle_updates(mut lane: gate::UpdateLane, handler: InboundHandler) {
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
pub(super) async fn pump(
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
pub(super) struct Supervision {
    report: Reporting,
    /// The task that moves the agent's output through the gate: ended before `Exited`,
    /// so no update is reported after it.
    pump: tokio::task::JoinHandle<()>,
}

/// Owns the connection and the process: runs them until either ends, reaps the process,
/// then reports how it ended (to `done` and, last of all, as `Exited`).
pub(super) async fn supervise<F>(
    connection: F,
    mut child: ManagedChild,
    stderr_task: StderrReader,
    shared: Arc<Shared>,
    report: Supervision,
) where
    F: Future<Output = Result<(), acp::Error>> + Send,
{
    let connection = async { connection.await.err().map(|e| e.message) };
    // The connection reads what the process wrote before it ended; dropping it (when the
    // wait is over) closes the agent's stdin.
    let ending = watch(
        &mut child,
        connection,
        DRAIN_AFTER_EXIT,
        std::future::pending::<()>(),
    )
    .await;
    let reaped = async {
        report.pump.abort();
        let _ = report.pump.await;
    };
    Exit::new("acp", &shared.events, &shared.stderr)
        .report(
            child,
            ending,
            vec![stderr_task],
            report.report,
            EXIT_AFTER_EOF,
            reaped,
        )
        .await;
}
