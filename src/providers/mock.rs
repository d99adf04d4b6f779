//! The built-in `mock` provider: a scripted ACP agent run as a real subprocess
//! (`agentry-mock`, or `agentry mock-agent`), driven by the prompt text (see CONTRACT.md), and the provider
//! configuration that runs it through the ACP adapter.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use agent_client_protocol::v1::schema as proto;
use agent_client_protocol::{self as acp, Agent, Client};
use futures::AsyncBufReadExt as _;
use serde_json::json;
use tokio::io::AsyncWriteExt as _;
use tokio::sync::{Notify, watch};
use tokio_util::compat::TokioAsyncReadCompatExt;
use uuid::Uuid;

use super::acp::{AcpProvider, AcpProviderConfig};
use super::{ModeInfo, ModelInfo};
use crate::process::lock;

/// The mock's modes: `default` asks for `/ask`, `unattended` allows it without asking.
const MODES: [(&str, &str, &str); 2] = [
    (
        "default",
        "Default",
        "Asks for permission when a prompt says /ask",
    ),
    (
        "unattended",
        "Unattended",
        "Allows everything without asking",
    ),
];
const MODELS: [(&str, &str); 2] = [("mock-small", "Mock small"), ("mock-large", "Mock large")];
/// Messages `/load` may have queued ahead of the writer before it waits.
const LOAD_QUEUE_HIGH: u64 = 1024;
const LOAD_QUEUE_LOW: u64 = 256;
/// Most events one `/load` emits.
pub const LOAD_MAX_EVENTS: u64 = 100_000;
/// Longest interval between two events of a `/load`, in milliseconds.
pub const LOAD_MAX_INTERVAL_MS: u64 = 60_000;
/// Longest a paced `/load` may run (events × interval), in milliseconds: ten minutes.
pub const LOAD_MAX_DURATION_MS: u64 = 10 * 60 * 1000;

/// The `mock` provider: the ACP adapter running `agentry-mock` when it is installed beside
/// `agentry_exe` (the same agent in a small executable: each start maps a few megabytes
/// rather than the whole server), else `<agentry_exe> mock-agent`.
pub fn mock_provider(agentry_exe: PathBuf) -> AcpProvider {
    let command = match crate::process::companion(&agentry_exe, "agentry-mock") {
        Some(small) => vec![small.to_string_lossy().into_owned()],
        None => vec![
            agentry_exe.to_string_lossy().into_owned(),
            "mock-agent".to_owned(),
        ],
    };
    AcpProvider::new(AcpProviderConfig {
        id: "mock".to_owned(),
        label: "Mock agent".to_owned(),
        command,
        env: Default::default(),
        pass_env: Vec::new(),
        modes: MODES
            .iter()
            .map(|(id, label, description)| ModeInfo {
                id: (*id).to_owned(),
                label: (*label).to_owned(),
                description: Some((*description).to_owned()),
                unattended: *id == "unattended",
            })
            .collect(),
        default_mode: Some("default".to_owned()),
        models: vec![
            ModelInfo {
                id: "mock-small".into(),
                label: "Mock small".into(),
                is_default: true,
                context_window: Some(100_000),
            },
            ModelInfo {
                id: "mock-large".into(),
                label: "Mock large".into(),
                is_default: false,
                context_window: Some(1_000_000),
            },
        ],
        model_flag: None,
        serve_reads: true,
        auth_method: None,
    })
    // The mock has no MCP client: it is not given agentry's MCP server.
    .without_mcp()
}

/// Run the mock ACP agent on stdin/stdout until stdin closes.
pub async fn run_stdio() -> anyhow::Result<()> {
    let (input, output, direct) = stdio()?;
    let incoming = futures::io::BufReader::with_capacity(64 * 1024, input.compat()).lines();
    let outbox = Arc::new(Outbox {
        state: Mutex::new(OutboxState::default()),
        wake_writer: Notify::new(),
        written: watch::channel(0).0,
        direct,
    });
    let writer = tokio::spawn(write_out(outbox.clone(), output));
    // The first paced `/load` finds its thread ready rather than starting one in the
    // midst of its turn (a thousand agents prompted at once would start a thousand).
    if let Err(e) = on_load_thread(Box::new(|| {})) {
        eprintln!("agentry-mock: no thread for /load yet: {e}");
    }
    let mock = Arc::new(MockAgent {
        sessions: Mutex::new(HashMap::new()),
        written: outbox.written.subscribe(),
        outbox: outbox.clone(),
    });
    let served = serve(mock, acp::Lines::new(OutboxSink(outbox), incoming)).await;
    writer.abort();
    served.map_err(|e| anyhow::anyhow!("mock agent connection failed: {}", e.message))
}

/// Lines on their way to stdout. The connection hands each line over without waiting
/// for a write; one writer task sends whatever has gathered since its last write, so a
/// burst of updates costs a few large writes rather than one per line.
struct Outbox {
    state: Mutex<OutboxState>,
    wake_writer: Notify,
    /// Lines written so far.
    written: watch::Sender<u64>,
    /// stdout, for a line written at once by a paced `/load` when nothing is queued
    /// ahead of it (`None` when stdout is a plain file).
    direct: Option<std::os::fd::OwnedFd>,
}

#[derive(Default)]
struct OutboxState {
    pending: Vec<u8>,
    pending_lines: u64,
    writing: bool,
    closed: bool,
    failed: Option<std::io::ErrorKind>,
    /// Senders waiting for room, or for everything to be written.
    waiting: Vec<Waker>,
}

/// Bytes the outbox takes before senders wait for the writer.
const OUTBOX_LIMIT: usize = 1 << 20;

impl Outbox {
    /// Queue one line written outside the connection (see `Turn::load`).
    fn push(&self, line: &[u8]) -> std::io::Result<()> {
        {
            let mut state = lock(&self.state);
            if let Some(kind) = state.failed {
                return Err(kind.into());
            }
            state.pending.extend_from_slice(line);
            state.pending.push(b'\n');
            state.pending_lines += 1;
        }
        self.wake_writer.notify_one();
        Ok(())
    }

    /// Write one line, its newline included, from outside the runtime (a paced `/load`'s
    /// thread): straight to stdout when nothing is queued or being written, so the line
    /// keeps its place and costs one system call; otherwise, or for what the pipe does not
    /// take at once, through the writer.
    fn write_now(&self, line: &[u8]) -> std::io::Result<()> {
        use std::os::fd::AsRawFd as _;
        let mut state = lock(&self.state);
        if let Some(kind) = state.failed {
            return Err(kind.into());
        }
        let mut rest = line;
        if let Some(fd) = self
            .direct
            .as_ref()
            .filter(|_| state.pending.is_empty() && !state.writing)
        {
            // SAFETY: writes from a live slice to a descriptor the outbox owns.
            let n = unsafe { libc::write(fd.as_raw_fd(), line.as_ptr().cast(), line.len()) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) {
                    return Err(e);
                }
            } else {
                rest = &line[n as usize..];
            }
            if rest.is_empty() {
                drop(state);
                self.written.send_modify(|n| *n += 1);
                return Ok(());
            }
        }
        state.pending.extend_from_slice(rest);
        state.pending_lines += 1;
        drop(state);
        self.wake_writer.notify_one();
        Ok(())
    }
}

impl OutboxState {
    fn wake_all(&mut self) {
        for waker in self.waiting.drain(..) {
            waker.wake();
        }
    }
}

struct OutboxSink(Arc<Outbox>);

impl futures::Sink<String> for OutboxSink {
    type Error = std::io::Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let mut state = lock(&self.0.state);
        if let Some(kind) = state.failed {
            return Poll::Ready(Err(kind.into()));
        }
        if state.pending.len() < OUTBOX_LIMIT {
            return Poll::Ready(Ok(()));
        }
        state.waiting.push(cx.waker().clone());
        Poll::Pending
    }

    fn start_send(self: Pin<&mut Self>, line: String) -> std::io::Result<()> {
        {
            let mut state = lock(&self.0.state);
            state.pending.extend_from_slice(line.as_bytes());
            state.pending.push(b'\n');
            state.pending_lines += 1;
        }
        self.0.wake_writer.notify_one();
        Ok(())
    }

    /// The line is with the writer, which writes it without further prompting.
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match lock(&self.0.state).failed {
            Some(kind) => Poll::Ready(Err(kind.into())),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        {
            let mut state = lock(&self.0.state);
            state.closed = true;
            if let Some(kind) = state.failed {
                return Poll::Ready(Err(kind.into()));
            }
            if state.pending.is_empty() && !state.writing {
                return Poll::Ready(Ok(()));
            }
            state.waiting.push(cx.waker().clone());
        }
        self.0.wake_writer.notify_one();
        Poll::Pending
    }
}

/// The writer task: moves gathered lines to stdout until the outbox is closed and empty.
async fn write_out(outbox: Arc<Outbox>, mut output: Writer) {
    let mut batch = Vec::new();
    loop {
        let lines = {
            let mut state = lock(&outbox.state);
            if state.pending.is_empty() {
                state.writing = false;
                state.wake_all();
                if state.closed {
                    return;
                }
                None
            } else {
                std::mem::swap(&mut state.pending, &mut batch);
                state.writing = true;
                state.wake_all();
                Some(std::mem::take(&mut state.pending_lines))
            }
        };
        let Some(lines) = lines else {
            outbox.wake_writer.notified().await;
            continue;
        };
        let written = match output.write_all(&batch).await {
            Ok(()) => output.flush().await,
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            let mut state = lock(&outbox.state);
            state.failed = Some(e.kind());
            state.writing = false;
            state.wake_all();
            return;
        }
        batch.clear();
        outbox.written.send_modify(|n| *n += lines);
    }
}

type Reader = Pin<Box<dyn tokio::io::AsyncRead + Send>>;
type Writer = Pin<Box<dyn tokio::io::AsyncWrite + Send>>;

/// stdin/stdout, polled without blocking when they are pipes (the usual case) or
/// terminals; plain files are read and written directly. The third part is a second
/// handle on stdout when it is a pipe (made non-blocking), for [`Outbox::write_now`].
fn stdio() -> std::io::Result<(Reader, Writer, Option<std::os::fd::OwnedFd>)> {
    use std::os::fd::AsFd;
    use tokio::net::unix::pipe;
    let stdin = std::io::stdin().as_fd().try_clone_to_owned()?;
    let input: Reader = match pipe::Receiver::from_owned_fd(stdin.try_clone()?) {
        Ok(pipe) => Box::pin(pipe),
        Err(_) => match pipe::Receiver::from_owned_fd_unchecked(stdin.try_clone()?) {
            Ok(pollable) => Box::pin(pollable),
            Err(_) => Box::pin(PlainFile(std::fs::File::from(stdin))),
        },
    };
    let stdout = std::io::stdout().as_fd().try_clone_to_owned()?;
    let (output, direct): (Writer, _) = match pipe::Sender::from_owned_fd(stdout.try_clone()?) {
        Ok(pipe) => (Box::pin(pipe), Some(stdout)),
        Err(_) => match pipe::Sender::from_owned_fd_unchecked(stdout.try_clone()?) {
            Ok(pollable) => (Box::pin(pollable), None),
            Err(_) => (Box::pin(PlainFile(std::fs::File::from(stdout))), None),
        },
    };
    Ok((input, output, direct))
}

/// A regular file as stdin/stdout: never blocks for long, so it is used synchronously.
struct PlainFile(std::fs::File);

impl tokio::io::AsyncRead for PlainFile {
    fn poll_read(
        self: Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::io::Read as _;
        let n = self.get_mut().0.read(buf.initialize_unfilled())?;
        buf.advance(n);
        std::task::Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncWrite for PlainFile {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::io::Write as _;
        std::task::Poll::Ready(self.get_mut().0.write(buf))
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::io::Write as _;
        std::task::Poll::Ready(self.get_mut().0.flush())
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.poll_flush(cx)
    }
}

struct MockAgent {
    sessions: Mutex<HashMap<String, MockSession>>,
    /// Lines written to stdout so far (for `/load` backpressure).
    written: watch::Receiver<u64>,
    /// Where `/load` writes its chunks itself.
    outbox: Arc<Outbox>,
}

struct MockSession {
    cwd: PathBuf,
    mode: String,
    model: String,
    busy: bool,
    /// Bumped by `session/cancel`; a turn stops when it moves.
    cancel: watch::Sender<u64>,
}

impl MockSession {
    fn new(cwd: PathBuf) -> Self {
        Self {
            cwd,
            mode: "default".to_owned(),
            model: MODELS[0].0.to_owned(),
            busy: false,
            cancel: watch::channel(0).0,
        }
    }
}

fn modes(current: &str) -> proto::SessionModeState {
    proto::SessionModeState::new(
        current.to_owned(),
        MODES
            .iter()
            .map(|(id, label, description)| {
                proto::SessionMode::new(*id, *label).description(*description)
            })
            .collect(),
    )
}

fn config_options(model: &str) -> Vec<proto::SessionConfigOption> {
    vec![
        proto::SessionConfigOption::select(
            "model",
            "Model",
            model.to_owned(),
            MODELS
                .iter()
                .map(|(id, label)| proto::SessionConfigSelectOption::new(*id, *label))
                .collect::<Vec<_>>(),
        )
        .category(proto::SessionConfigOptionCategory::Model),
    ]
}

fn unknown_session(id: &proto::SessionId) -> acp::Error {
    proto::Error::session_not_found(id.clone()).into()
}

fn internal(message: impl ToString) -> acp::Error {
    acp::Error::new(acp::ErrorCode::INTERNAL_ERROR, message.to_string())
}

fn invalid(message: impl Into<String>) -> acp::Error {
    acp::Error::new(acp::ErrorCode::INVALID_PARAMS, message)
}

async fn serve(
    mock: Arc<MockAgent>,
    transport: impl acp::ConnectTo<Agent> + 'static,
) -> acp::Result<()> {
    let (for_new, for_load, for_mode, for_model, for_prompt, for_cancel) = (
        mock.clone(),
        mock.clone(),
        mock.clone(),
        mock.clone(),
        mock.clone(),
        mock,
    );
    Agent
        .v1()
        .name("agentry-mock")
        .on_receive_request(
            async move |_request: proto::InitializeRequest, responder, _cx| {
                responder.respond(
                    proto::InitializeResponse::new(acp::schema::ProtocolVersion::V1)
                        .agent_capabilities(proto::AgentCapabilities::new().load_session(true))
                        .agent_info(proto::Implementation::new(
                            "agentry-mock",
                            env!("CARGO_PKG_VERSION"),
                        )),
                )
            },
            acp::on_receive_request!(),
        )
        .on_receive_request(
            async move |request: proto::NewSessionRequest, responder, _cx| {
                let id = Uuid::now_v7().to_string();
                lock(&for_new.sessions).insert(id.clone(), MockSession::new(request.cwd));
                responder.respond(
                    proto::NewSessionResponse::new(id)
                        .modes(modes("default"))
                        .config_options(config_options(MODELS[0].0)),
                )
            },
            acp::on_receive_request!(),
        )
        .on_receive_request(
            async move |request: proto::LoadSessionRequest, responder, _cx| {
                // The mock keeps no history: any id reopens as a fresh session.
                let session = MockSession::new(request.cwd);
                let response = proto::LoadSessionResponse::new()
                    .modes(modes(&session.mode))
                    .config_options(config_options(&session.model));
                lock(&for_load.sessions).insert(request.session_id.to_string(), session);
                responder.respond(response)
            },
            acp::on_receive_request!(),
        )
        .on_receive_request(
            async move |request: proto::SetSessionModeRequest, responder, cx| {
                let mode = request.mode_id.to_string();
                if !MODES.iter().any(|(id, ..)| *id == mode) {
                    return responder.respond_with_error(invalid(format!("unknown mode `{mode}`")));
                }
                match lock(&for_mode.sessions).get_mut(&*request.session_id.0) {
                    Some(session) => session.mode.clone_from(&mode),
                    None => {
                        return responder.respond_with_error(unknown_session(&request.session_id));
                    }
                }
                cx.send_notification(proto::SessionNotification::new(
                    request.session_id,
                    proto::SessionUpdate::CurrentModeUpdate(proto::CurrentModeUpdate::new(mode)),
                ))?;
                responder.respond(proto::SetSessionModeResponse::new())
            },
            acp::on_receive_request!(),
        )
        .on_receive_request(
            async move |request: proto::SetSessionConfigOptionRequest, responder, cx| {
                if &*request.config_id.0 != "model" {
                    return responder.respond_with_error(invalid(format!(
                        "unknown config option `{}`",
                        request.config_id
                    )));
                }
                let Some(model) = request.value.as_value_id().map(ToString::to_string) else {
                    return responder
                        .respond_with_error(invalid("the model must be one of the listed values"));
                };
                if !MODELS.iter().any(|(id, _)| *id == model) {
                    return responder
                        .respond_with_error(invalid(format!("unknown model `{model}`")));
                }
                match lock(&for_model.sessions).get_mut(&*request.session_id.0) {
                    Some(session) => session.model.clone_from(&model),
                    None => {
                        return responder.respond_with_error(unknown_session(&request.session_id));
                    }
                }
                cx.send_notification(proto::SessionNotification::new(
                    request.session_id,
                    proto::SessionUpdate::ConfigOptionUpdate(proto::ConfigOptionUpdate::new(
                        config_options(&model),
                    )),
                ))?;
                responder.respond(proto::SetSessionConfigOptionResponse::new(config_options(
                    &model,
                )))
            },
            acp::on_receive_request!(),
        )
        .on_receive_request(
            async move |request: proto::PromptRequest, responder, cx| {
                let text = request
                    .prompt
                    .iter()
                    .find_map(|block| match block {
                        proto::ContentBlock::Text(text) => Some(text.text.clone()),
                        _ => None,
                    })
                    .unwrap_or_default();
                let turn = {
                    let mut sessions = lock(&for_prompt.sessions);
                    let Some(session) = sessions.get_mut(&*request.session_id.0) else {
                        return responder.respond_with_error(unknown_session(&request.session_id));
                    };
                    if session.busy {
                        return responder
                            .respond_with_error(invalid("a prompt is already running"));
                    }
                    session.busy = true;
                    let cancel = session.cancel.subscribe();
                    let started = *cancel.borrow();
                    Turn {
                        cx: cx.clone(),
                        session_id: request.session_id.clone(),
                        cwd: session.cwd.clone(),
                        unattended: session.mode == "unattended",
                        cancel,
                        started,
                        written: for_prompt.written.clone(),
                        outbox: for_prompt.outbox.clone(),
                    }
                };
                let mock = for_prompt.clone();
                // A task of its own: a paced turn's timer wakes it alone, not the whole
                // connection.
                tokio::spawn(async move {
                    let session_id = turn.session_id.clone();
                    let result = turn.run(&text).await;
                    if let Some(session) = lock(&mock.sessions).get_mut(&*session_id.0) {
                        session.busy = false;
                    }
                    let _ = responder.respond_with_result(result);
                });
                Ok(())
            },
            acp::on_receive_request!(),
        )
        .on_receive_notification(
            async move |notification: proto::CancelNotification, _cx| {
                if let Some(session) = lock(&for_cancel.sessions).get(&*notification.session_id.0) {
                    session.cancel.send_modify(|epoch| *epoch += 1);
                }
                Ok(())
            },
            acp::on_receive_notification!(),
        )
        .connect_to(transport)
        .await
}

/// One running prompt.
struct Turn {
    cx: acp::v1::ConnectionTo<Client>,
    session_id: proto::SessionId,
    cwd: PathBuf,
    unattended: bool,
    cancel: watch::Receiver<u64>,
    started: u64,
    written: watch::Receiver<u64>,
    outbox: Arc<Outbox>,
}

/// The turn was cancelled; it ends with `stopReason: cancelled`.
struct Cancelled;

impl Turn {
    async fn run(mut self, text: &str) -> acp::Result<proto::PromptResponse> {
        let text = text.trim();
        let (command, rest) = match text.split_once(char::is_whitespace) {
            Some((command, rest)) => (command, rest.trim()),
            None => (text, ""),
        };
        let outcome = match command {
            "/tool" => self.tool(rest).await,
            "/ask" => self.ask(rest).await,
            "/fail" => return Err(internal(rest)),
            "/sleep" => self.sleep(rest).await,
            "/load" => self.load(rest).await,
            "/write" => self.write(rest).await,
            "/env" => self.env(rest).map(Ok),
            "/usage" => {
                let usage = self.usage(rest)?;
                return Ok(proto::PromptResponse::new(proto::StopReason::EndTurn).meta(usage));
            }
            "/tokens" => {
                let usage = self.tokens(rest)?;
                return Ok(proto::PromptResponse::new(proto::StopReason::EndTurn).meta(usage));
            }
            "/spend" => {
                let (stop, usage) = self.spend(rest).await?;
                return Ok(proto::PromptResponse::new(stop).meta(usage));
            }
            _ => self.reply(&format!("You said: {text}")).map(Ok),
        };
        match outcome? {
            Ok(()) => Ok(proto::PromptResponse::new(proto::StopReason::EndTurn)),
            Err(Cancelled) => Ok(proto::PromptResponse::new(proto::StopReason::Cancelled)),
        }
    }

    /// `/usage <input> <output>`: reports the context window in use (input + output of a
    /// 200,000-token window) and a cost, replies, and ends the turn with that many tokens
    /// (in the answer's `_meta`, where Gemini reports a turn's tokens); the answer's meta.
    fn usage(&self, args: &str) -> acp::Result<serde_json::Map<String, serde_json::Value>> {
        const USAGE: &str = "/usage needs <input_tokens> <output_tokens>";
        let numbers = numbers(args, USAGE)?;
        let [input, output] = numbers[..] else {
            return Err(invalid(USAGE));
        };
        let cost = (input as f64 * 3.0 + output as f64 * 15.0) / 1_000_000.0;
        self.update(proto::SessionUpdate::UsageUpdate(
            proto::UsageUpdate::new(input + output, 200_000).cost(proto::Cost::new(cost, "USD")),
        ))?;
        self.reply(&format!("Used {input} input and {output} output tokens."))?;
        Ok(token_meta(input, output))
    }

    /// `/tokens <input> <output>`: replies and ends the turn with that many tokens and no
    /// cost (a CLI that reports none: the server's price table estimates it).
    fn tokens(&self, args: &str) -> acp::Result<serde_json::Map<String, serde_json::Value>> {
        const USAGE: &str = "/tokens needs <input_tokens> <output_tokens>";
        let numbers = numbers(args, USAGE)?;
        let [input, output] = numbers[..] else {
            return Err(invalid(USAGE));
        };
        self.reply(&format!("Used {input} input and {output} output tokens."))?;
        Ok(token_meta(input, output))
    }

    /// `/spend <input> <output> <steps> <pause_ms>`: a turn of `steps` model calls, each of
    /// `input` and `output` tokens, with a `usage` update after each (the turn's cost so
    /// far) and a pause between them; a cancel ends it after the call in progress. The
    /// answer's meta holds the tokens of the calls made.
    async fn spend(
        &mut self,
        args: &str,
    ) -> acp::Result<(
        proto::StopReason,
        serde_json::Map<String, serde_json::Value>,
    )> {
        const USAGE: &str = "/spend needs <input_tokens> <output_tokens> <steps> <pause_ms>";
        let numbers = numbers(args, USAGE)?;
        let [input, output, steps, pause] = numbers[..] else {
            return Err(invalid(USAGE));
        };
        if steps == 0 || steps > 1000 || pause > 60_000 {
            return Err(invalid("/spend takes 1 to 1000 steps of at most 60000 ms"));
        }
        let mut made = 0;
        let mut stop = proto::StopReason::EndTurn;
        for step in 1..=steps {
            made = step;
            let cost = (step * input) as f64 * 3.0 / 1_000_000.0
                + (step * output) as f64 * 15.0 / 1_000_000.0;
            self.update(proto::SessionUpdate::UsageUpdate(
                proto::UsageUpdate::new(step * (input + output), 200_000)
                    .cost(proto::Cost::new(cost, "USD")),
            ))?;
            if step == steps {
                break;
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(pause)) => {}
                () = self.cancelled() => {
                    stop = proto::StopReason::Cancelled;
                    break;
                }
            }
        }
        if stop == proto::StopReason::EndTurn {
            self.reply(&format!("Spent {made} calls."))?;
        }
        Ok((stop, token_meta(made * input, made * output)))
    }

    fn is_cancelled(&self) -> bool {
        *self.cancel.borrow() != self.started
    }

    /// Resolves when `session/cancel` arrives for this turn.
    async fn cancelled(&mut self) {
        let started = self.started;
        if self
            .cancel
            .wait_for(|epoch| *epoch != started)
            .await
            .is_err()
        {
            std::future::pending::<()>().await;
        }
    }

    fn update(&self, update: proto::SessionUpdate) -> acp::Result<()> {
        self.cx.send_notification(proto::SessionNotification::new(
            self.session_id.clone(),
            update,
        ))
    }

    fn chunk(&self, message_id: &str, text: &str) -> acp::Result<()> {
        self.update(proto::SessionUpdate::AgentMessageChunk(
            proto::ContentChunk::new(proto::ContentBlock::Text(proto::TextContent::new(text)))
                .message_id(proto::MessageId::new(message_id)),
        ))
    }

    /// A chunk written straight to the outbox, the same line the connection would write:
    /// `/load` emits many, and the connection's path (a JSON value, its queues and tasks)
    /// would cost the mock more than the server it measures.
    fn raw_chunk(&self, message_id: &str, text: &str) -> acp::Result<()> {
        let line = self.chunk_line(message_id, text)?;
        self.outbox.push(&line).map_err(internal)
    }

    /// The `session/update` line of one message chunk, without its newline.
    fn chunk_line(&self, message_id: &str, text: &str) -> acp::Result<Vec<u8>> {
        #[derive(serde::Serialize)]
        struct Notification<'a> {
            jsonrpc: &'static str,
            method: &'static str,
            params: &'a proto::SessionNotification,
        }
        let params = proto::SessionNotification::new(
            self.session_id.clone(),
            proto::SessionUpdate::AgentMessageChunk(
                proto::ContentChunk::new(proto::ContentBlock::Text(proto::TextContent::new(text)))
                    .message_id(proto::MessageId::new(message_id)),
            ),
        );
        serde_json::to_vec(&Notification {
            jsonrpc: "2.0",
            method: "session/update",
            params: &params,
        })
        .map_err(internal)
    }

    /// One assistant message, streamed word by word.
    fn reply(&self, text: &str) -> acp::Result<()> {
        let message_id = Uuid::now_v7().to_string();
        for piece in text.split_inclusive(' ') {
            self.chunk(&message_id, piece)?;
        }
        Ok(())
    }

    fn tool_update(&self, call_id: &str, fields: proto::ToolCallUpdateFields) -> acp::Result<()> {
        self.update(proto::SessionUpdate::ToolCallUpdate(
            proto::ToolCallUpdate::new(call_id.to_owned(), fields),
        ))
    }

    async fn tool(&mut self, command: &str) -> acp::Result<Result<(), Cancelled>> {
        let call_id = format!("call_{}", Uuid::now_v7().simple());
        self.update(proto::SessionUpdate::ToolCall(
            proto::ToolCall::new(call_id.clone(), command)
                .kind(proto::ToolKind::Execute)
                .status(proto::ToolCallStatus::InProgress)
                .raw_input(json!({ "command": command })),
        ))?;
        // Nothing is run: the mock only reports what a shell tool would.
        self.tool_update(
            &call_id,
            proto::ToolCallUpdateFields::new()
                .status(proto::ToolCallStatus::Completed)
                .raw_output(json!({ "stdout": format!("{command}\n"), "exit_code": 0 })),
        )?;
        self.reply(&format!("Ran `{command}`: exit code 0."))?;
        Ok(Ok(()))
    }

    async fn ask(&mut self, title: &str) -> acp::Result<Result<(), Cancelled>> {
        let call_id = format!("call_{}", Uuid::now_v7().simple());
        let input = json!({ "title": title });
        self.update(proto::SessionUpdate::ToolCall(
            proto::ToolCall::new(call_id.clone(), title)
                .kind(proto::ToolKind::Execute)
                .status(proto::ToolCallStatus::Pending)
                .raw_input(input.clone()),
        ))?;
        let option_id = if self.unattended {
            "allow".to_owned()
        } else {
            let request = proto::RequestPermissionRequest::new(
                self.session_id.clone(),
                proto::ToolCallUpdate::new(
                    call_id.clone(),
                    proto::ToolCallUpdateFields::new()
                        .title(title.to_owned())
                        .kind(proto::ToolKind::Execute)
                        .status(proto::ToolCallStatus::Pending)
                        .raw_input(input),
                ),
                vec![
                    proto::PermissionOption::new(
                        "allow",
                        "Allow",
                        proto::PermissionOptionKind::AllowOnce,
                    ),
                    proto::PermissionOption::new(
                        "deny",
                        "Deny",
                        proto::PermissionOptionKind::RejectOnce,
                    ),
                ],
            );
            let asked = self.cx.send_request(request).block_task();
            let answer = tokio::select! {
                answer = asked => Some(answer?),
                () = self.cancelled() => None,
            };
            match answer.map(|a| a.outcome) {
                Some(proto::RequestPermissionOutcome::Selected(selected)) => {
                    selected.option_id.to_string()
                }
                _ => {
                    self.tool_update(
                        &call_id,
                        proto::ToolCallUpdateFields::new().status(proto::ToolCallStatus::Failed),
                    )?;
                    return Ok(Err(Cancelled));
                }
            }
        };
        let behavior = if option_id == "allow" {
            "allow"
        } else {
            "deny"
        };
        let status = if behavior == "allow" {
            proto::ToolCallStatus::Completed
        } else {
            proto::ToolCallStatus::Failed
        };
        self.tool_update(&call_id, proto::ToolCallUpdateFields::new().status(status))?;
        self.reply(&format!(
            "Permission for {title}: {behavior} (option {option_id})"
        ))?;
        Ok(Ok(()))
    }

    async fn sleep(&mut self, millis: &str) -> acp::Result<Result<(), Cancelled>> {
        let Ok(millis) = millis.parse::<u64>() else {
            return Err(invalid(format!(
                "/sleep needs a number of milliseconds, not `{millis}`"
            )));
        };
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(millis)) => {}
            () = self.cancelled() => return Ok(Err(Cancelled)),
        }
        self.reply(&format!("Slept for {millis} ms."))?;
        Ok(Ok(()))
    }

    async fn load(&mut self, args: &str) -> acp::Result<Result<(), Cancelled>> {
        const USAGE: &str = "/load needs <events> <interval_ms> [stamp]";
        let mut words = args.split_whitespace();
        let Some(Ok(events)) = words.next().map(str::parse::<u64>) else {
            return Err(invalid(USAGE));
        };
        let Ok(interval) = words.next().map_or(Ok(0), str::parse::<u64>) else {
            return Err(invalid(USAGE));
        };
        let stamp = match (words.next(), words.next()) {
            (None, _) => false,
            (Some("stamp"), None) => true,
            _ => return Err(invalid(USAGE)),
        };
        check_load(events, interval).map_err(invalid)?;
        let message_id = Uuid::now_v7().to_string();
        if interval > 0 {
            return self
                .paced_load(&message_id, events, Duration::from_millis(interval), stamp)
                .await;
        }
        let mut target = *self.written.borrow();
        for i in 0..events {
            if self.is_cancelled() {
                return Ok(Err(Cancelled));
            }
            let stamp = stamp.then(unix_micros);
            self.raw_chunk(&message_id, &load_chunk_text(i, stamp))?;
            target += 1;
            if target.saturating_sub(*self.written.borrow()) > LOAD_QUEUE_HIGH {
                // Let the writer catch up instead of queueing the whole burst in memory.
                let low = target - LOAD_QUEUE_LOW;
                let mut written = self.written.clone();
                tokio::select! {
                    _ = written.wait_for(|written| *written >= low) => {}
                    () = self.cancelled() => return Ok(Err(Cancelled)),
                }
            }
        }
        Ok(Ok(()))
    }

    /// A paced `/load` keeps to a schedule (event `i` at start + `i` × interval, so the
    /// rate is what was asked for even when a wake-up comes late), on a thread of its own
    /// that sleeps until each event, stamps it and writes its line: one wake-up and one
    /// write per event. On the runtime, an event woke the timer, the turn's task and the
    /// writer's task, and with a thousand mock agents at 10 events/s the agents took a
    /// third of a two-core machine from the server they stand beside.
    async fn paced_load(
        &mut self,
        message_id: &str,
        events: u64,
        interval: Duration,
        stamp: bool,
    ) -> acp::Result<Result<(), Cancelled>> {
        const MARK: &str = "<load chunk>";
        let template = self.chunk_line(message_id, MARK)?;
        let at = template
            .windows(MARK.len())
            .position(|w| w == MARK.as_bytes())
            .ok_or_else(|| internal("the chunk line lost its text"))?;
        let (head, tail) = (
            template[..at].to_vec(),
            template[at + MARK.len()..].to_vec(),
        );
        let pacer = Arc::new(Pacer::default());
        // Stops the thread however this turn ends, also when it is dropped.
        let _stop = StopOnDrop(pacer.clone());
        let (done, mut finished) = tokio::sync::oneshot::channel();
        let (outbox, thread_pacer) = (self.outbox.clone(), pacer.clone());
        on_load_thread(Box::new(move || {
            let mut line = Vec::with_capacity(head.len() + tail.len() + 32);
            let start = std::time::Instant::now();
            // Event `i` is due at start + `i` × interval; none is due after the end of time.
            let due = |i: u64| {
                u32::try_from(i)
                    .ok()
                    .and_then(|i| interval.checked_mul(i))
                    .and_then(|after| start.checked_add(after))
            };
            let mut written = Ok(());
            for i in 0..events {
                if !thread_pacer.wait_until(due(i)) {
                    break;
                }
                line.clear();
                line.extend_from_slice(&head);
                line.extend_from_slice(load_chunk_text(i, stamp.then(unix_micros)).as_bytes());
                line.extend_from_slice(&tail);
                line.push(b'\n');
                if let Err(e) = outbox.write_now(&line) {
                    written = Err(e);
                    break;
                }
            }
            // The last event's interval passes too before the turn ends.
            if written.is_ok() {
                thread_pacer.wait_until(due(events));
            }
            let _ = done.send(written);
        }))
        .map_err(|e| internal(format!("no thread for /load: {e}")))?;
        tokio::select! {
            written = &mut finished => {
                written
                    .map_err(|_| internal("the /load thread ended without its result"))?
                    .map_err(internal)?;
                Ok(Ok(()))
            }
            () = self.cancelled() => {
                // The turn ends only once the thread has written its last line.
                pacer.stop();
                let _ = finished.await;
                Ok(Err(Cancelled))
            }
        }
    }

    /// `/env NAME`: whether the process has `NAME` in its environment, told by a digest
    /// of the value (`NAME sha256=<hex>`, or `NAME unset`), so a test can check a value
    /// that must not appear in any timeline.
    fn env(&self, name: &str) -> acp::Result<()> {
        use sha2::{Digest, Sha256};
        let text = match std::env::var(name) {
            Ok(v) => format!(
                "{name} sha256={}",
                hex::encode(Sha256::digest(v.as_bytes()))
            ),
            Err(_) => format!("{name} unset"),
        };
        self.reply(&text)
    }

    async fn write(&mut self, args: &str) -> acp::Result<Result<(), Cancelled>> {
        let (path, content) = args.split_once(' ').unwrap_or((args, ""));
        let call_id = format!("call_{}", Uuid::now_v7().simple());
        let title = format!("Write {path}");
        let input = json!({ "path": path, "content": content });
        let relative = Path::new(path);
        let inside = !path.is_empty()
            && relative
                .components()
                .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
        if !inside {
            self.update(proto::SessionUpdate::ToolCall(
                proto::ToolCall::new(call_id, title)
                    .kind(proto::ToolKind::Edit)
                    .status(proto::ToolCallStatus::Failed)
                    .raw_input(input)
                    .content(vec![
                        "the path must be relative and stay inside the workspace".into(),
                    ]),
            ))?;
            self.reply(&format!(
                "Could not write {path}: the path must be relative and stay inside the workspace."
            ))?;
            return Ok(Ok(()));
        }
        let target = self.cwd.join(relative);
        self.update(proto::SessionUpdate::ToolCall(
            proto::ToolCall::new(call_id.clone(), title)
                .kind(proto::ToolKind::Edit)
                .status(proto::ToolCallStatus::InProgress)
                .raw_input(input)
                .content(vec![proto::Diff::new(target.clone(), content).into()]),
        ))?;
        match write_inside(&self.cwd, relative, content).await {
            Ok(()) => {
                self.tool_update(
                    &call_id,
                    proto::ToolCallUpdateFields::new().status(proto::ToolCallStatus::Completed),
                )?;
                self.reply(&format!("Wrote {} bytes to {path}.", content.len()))?;
            }
            Err(e) => {
                self.tool_update(
                    &call_id,
                    proto::ToolCallUpdateFields::new()
                        .status(proto::ToolCallStatus::Failed)
                        .content(vec![e.clone().into()]),
                )?;
                self.reply(&format!("Could not write {path}: {e}"))?;
            }
        }
        Ok(Ok(()))
    }
}

/// The bounds of one `/load`: a turn that asks for more fails with the reason, having
/// emitted nothing.
pub fn check_load(events: u64, interval_ms: u64) -> Result<(), String> {
    if events > LOAD_MAX_EVENTS {
        return Err(format!("/load emits at most {LOAD_MAX_EVENTS} events"));
    }
    if interval_ms > LOAD_MAX_INTERVAL_MS {
        return Err(format!(
            "/load waits at most {LOAD_MAX_INTERVAL_MS} ms between events"
        ));
    }
    if events.saturating_mul(interval_ms) > LOAD_MAX_DURATION_MS {
        return Err(format!(
            "/load runs at most {LOAD_MAX_DURATION_MS} ms (events × interval_ms)"
        ));
    }
    Ok(())
}

/// The text of `/load`'s chunk `i`: `"<i> "`, or with an emission stamp
/// `"<i>@<microseconds since the Unix epoch> "`, taken just before the chunk is sent, so
/// a reader on the same machine can tell how long the event took to reach it.
pub fn load_chunk_text(i: u64, stamp_us: Option<i64>) -> String {
    match stamp_us {
        Some(us) => format!("{i}@{us} "),
        None => format!("{i} "),
    }
}

/// Work for a load thread.
type LoadJob = Box<dyn FnOnce() + Send>;

/// Load threads waiting for their next paced `/load`. A thread outlives its load, so the
/// next turn does not pay for a new one, and its CPU time stays on the process's books
/// (`/proc/<pid>/task`) where a benchmark reads it.
static IDLE_LOAD_THREADS: Mutex<Vec<std::sync::mpsc::Sender<LoadJob>>> = Mutex::new(Vec::new());

/// Run `job` on an idle load thread, or on a new one when none is idle.
fn on_load_thread(job: LoadJob) -> std::io::Result<()> {
    let mut job = job;
    while let Some(thread) = lock(&IDLE_LOAD_THREADS).pop() {
        match thread.send(job) {
            Ok(()) => return Ok(()),
            Err(std::sync::mpsc::SendError(back)) => job = back,
        }
    }
    std::thread::Builder::new()
        .name("mock-load".to_owned())
        .spawn(move || {
            let (next, jobs) = std::sync::mpsc::channel();
            job();
            loop {
                lock(&IDLE_LOAD_THREADS).push(next.clone());
                match jobs.recv() {
                    Ok(job) => job(),
                    Err(_) => return,
                }
            }
        })
        .map(drop)
}

/// A paced `/load`'s clock, which `session/cancel` (or the end of the turn) stops at once.
#[derive(Default)]
struct Pacer {
    stopped: Mutex<bool>,
    wake: std::sync::Condvar,
}

impl Pacer {
    fn stop(&self) {
        *lock(&self.stopped) = true;
        self.wake.notify_all();
    }

    /// Sleep until `due` (`None`: never): true then, false as soon as the pacer is stopped.
    fn wait_until(&self, due: Option<std::time::Instant>) -> bool {
        let mut stopped = lock(&self.stopped);
        loop {
            if *stopped {
                return false;
            }
            let now = std::time::Instant::now();
            stopped = match due {
                Some(due) if now >= due => return true,
                Some(due) => {
                    self.wake
                        .wait_timeout(stopped, due - now)
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .0
                }
                None => self
                    .wake
                    .wait(stopped)
                    .unwrap_or_else(|poisoned| poisoned.into_inner()),
            };
        }
    }
}

struct StopOnDrop(Arc<Pacer>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// Reads a chunk written by [`load_chunk_text`] back: its index and stamp, if any.
pub fn parse_load_chunk(text: &str) -> Option<(u64, Option<i64>)> {
    let text = text.strip_suffix(' ')?;
    match text.split_once('@') {
        Some((i, us)) => Some((i.parse().ok()?, Some(us.parse().ok()?))),
        None => Some((text.parse().ok()?, None)),
    }
}

/// Microseconds since the Unix epoch on the wall clock.
pub fn unix_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Write `content` to `relative` inside `cwd`, confined (see
/// [`super::workspace_files`]: no `.git` component, no symlink out of the workspace).
async fn write_inside(cwd: &Path, relative: &Path, content: &str) -> Result<(), String> {
    super::workspace_files::write(cwd, relative, content.as_bytes().to_vec())
        .await
        .map_err(|e| e.to_string())
}

/// The whitespace-separated numbers of a command's arguments (`usage` when one is not).
fn numbers(args: &str, usage: &str) -> acp::Result<Vec<u64>> {
    args.split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|_| invalid(usage))
}

/// An answer's meta with a turn's tokens, where Gemini reports them.
fn token_meta(input: u64, output: u64) -> serde_json::Map<String, serde_json::Value> {
    let meta = json!({"quota": {"token_count": {"input_tokens": input, "output_tokens": output}}});
    meta.as_object().cloned().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_are_bounded() {
        assert!(check_load(LOAD_MAX_EVENTS, 0).is_ok());
        assert!(check_load(100, 100).is_ok());
        assert!(check_load(LOAD_MAX_EVENTS + 1, 0).is_err());
        assert!(check_load(1, LOAD_MAX_INTERVAL_MS + 1).is_err());
        assert!(check_load(u64::MAX, u64::MAX).is_err());
        let e = check_load(60_001, 10).unwrap_err();
        assert!(e.contains("600000 ms"), "{e}");
    }

    #[test]
    fn load_chunks_read_back_with_and_without_a_stamp() {
        assert_eq!(load_chunk_text(7, None), "7 ");
        assert_eq!(parse_load_chunk(&load_chunk_text(7, None)), Some((7, None)));
        let text = load_chunk_text(12, Some(1_764_557_416_123_456));
        assert_eq!(text, "12@1764557416123456 ");
        assert_eq!(
            parse_load_chunk(&text),
            Some((12, Some(1_764_557_416_123_456)))
        );
        assert_eq!(parse_load_chunk("12@x "), None);
        assert_eq!(parse_load_chunk("12"), None);
    }

    #[test]
    fn the_small_executable_runs_the_mock_when_it_is_beside_agentry() {
        let dir = tempfile::tempdir().unwrap();
        let agentry = dir.path().join("agentry");
        std::fs::write(&agentry, "").unwrap();
        let command = |p: &AcpProvider| p.config().command.clone();
        let alone = vec![agentry.display().to_string(), "mock-agent".to_owned()];
        assert_eq!(command(&mock_provider(agentry.clone())), alone);
        let small = dir.path().join("agentry-mock");
        std::fs::write(&small, "").unwrap();
        assert_eq!(
            command(&mock_provider(agentry)),
            vec![small.display().to_string()]
        );
    }
}
