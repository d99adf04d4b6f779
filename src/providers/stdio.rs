//! What the adapters that speak line-delimited JSON on the CLI's stdio share (Claude
//! Code's stream-json, Pi's rpc): starting the CLI with its stdin as the session's
//! writer, reading one JSON message a line from its stdout, waiting for the answer to a
//! request written to stdin, and supervising the process. What a message means stays
//! each adapter's own (its `mapping`).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::process::ChildStdout;
use tokio::sync::oneshot;

use super::emitter::{Emitter, StopSignals};
use super::supervise::{Exit, watch};
use super::{EventSink, ProcessLauncher, ProviderError, ProviderEvent};
use crate::process::framing::{FramingError, LineReader};
use crate::process::line_writer::LineWriter;
use crate::process::output::{StderrReader, StderrTail};
use crate::process::{CommandSpec, ManagedChild, lock};

/// Longest stdout line kept; a longer one is reported and skipped.
pub const MAX_LINE: usize = 16 * 1024 * 1024;

/// A line-JSON CLI as its adapter drives it.
pub struct Cli {
    /// Its name in what a session reports ("Claude Code").
    pub name: &'static str,
    /// The adapter, for the log.
    pub agent: &'static str,
    /// The log target of its stderr.
    pub stderr_log: &'static str,
    /// After the process exits, how long its remaining output may take to be read (a
    /// tool's child still holding the pipe must not delay the failure of the turn).
    pub drain: Duration,
    /// After its stdin is closed, how long it may take to finish and exit on its own.
    pub after_eof: Duration,
}

/// What a session's reader, handle and supervisor share of its CLI: the sink of its
/// events, the CLI's stdin and the last lines of its stderr.
pub struct Io {
    pub events: Emitter,
    pub writer: LineWriter,
    pub stderr: StderrTail,
}

impl Io {
    pub fn new<W: AsyncWrite + Send + Unpin + 'static>(
        events: EventSink,
        stdin: W,
        stderr: StderrTail,
    ) -> Self {
        Self {
            events: Emitter::new(events),
            writer: LineWriter::new(stdin),
            stderr,
        }
    }
}

/// A started CLI, until its supervisor owns it.
pub struct Process {
    child: ManagedChild,
    stdout: ChildStdout,
    stderr: StderrReader,
}

impl Process {
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }
}

impl Cli {
    /// Start the CLI: its stdin becomes the session's writer, its stderr is kept (masked)
    /// for the log and for the description of its end.
    pub async fn launch(
        &self,
        launcher: &dyn ProcessLauncher,
        command: CommandSpec,
        events: EventSink,
    ) -> Result<(Io, Process), ProviderError> {
        let mut child = launcher.launch(command).await?;
        let Some((stdin, stdout, stderr)) = child.take_stdio().await else {
            return Err(ProviderError::Protocol(format!(
                "{} has no piped stdio",
                self.name
            )));
        };
        let (tail, stderr) = StderrTail::capture_masked(stderr, self.stderr_log, child.redactor());
        let process = Process {
            child,
            stdout,
            stderr,
        };
        Ok((Io::new(events, stdin, tail), process))
    }

    /// Read `stdout` to its end, handing each message to the session, in order (each
    /// message's events go out before the next is read). Resolves with why the output
    /// broke, if it did.
    pub async fn read<S: Session, R: AsyncRead + Unpin>(
        &self,
        stdout: R,
        session: Arc<S>,
        mut mapper: S::Mapper,
    ) -> Option<String> {
        let mut lines = JsonLines::new(stdout, self.name);
        loop {
            match lines.next().await {
                Line::Message(message) => session.handle(&mut mapper, &message).await,
                // Reported, and passed over.
                Line::Invalid(message) => {
                    tracing::warn!(cli = self.name, %message, "a line of the CLI's output was skipped");
                    session
                        .io()
                        .events
                        .emit(ProviderEvent::Error {
                            message,
                            code: Some("provider_output_invalid".to_owned()),
                        })
                        .await;
                }
                Line::End(broken) => return broken,
            }
        }
    }

    /// Own the process: read what it writes until its output ends, it exits or the
    /// session is closed (`signals`); then close its stdin (which asks it to finish),
    /// wind it down, let the session forget what waits for an answer, and report how it
    /// ended (to the `Stopper`, and last of all as `Exited`).
    pub async fn supervise<S: Session>(
        &self,
        process: Process,
        session: Arc<S>,
        mapper: S::Mapper,
        signals: StopSignals,
    ) {
        let Process {
            mut child,
            stdout,
            stderr,
        } = process;
        let reading = self.read(stdout, session.clone(), mapper);
        let ending = watch(&mut child, reading, self.drain, signals.close).await;
        let io = session.io();
        io.writer.close().await;
        let reaped = async { session.forget() };
        Exit::new(self.agent, &io.events, &io.stderr)
            .report(
                child,
                ending,
                vec![stderr],
                signals.report,
                self.after_eof,
                reaped,
            )
            .await;
    }
}

/// A line-JSON adapter's live session, as its reader and supervisor see it.
pub trait Session: Send + Sync + 'static {
    /// What makes the session's events of the CLI's messages.
    type Mapper: Send;
    fn io(&self) -> &Io;
    /// Act on one message of the CLI's.
    fn handle(
        self: &Arc<Self>,
        mapper: &mut Self::Mapper,
        message: &Value,
    ) -> impl Future<Output = ()> + Send;
    /// The process is gone: nobody will answer what still waits.
    fn forget(&self);
}

/// One step of reading a CLI's stdout.
pub enum Line {
    Message(Value),
    /// A line that is not a JSON message, described for the session's log.
    Invalid(String),
    /// The output ended, with why it broke when it did.
    End(Option<String>),
}

/// JSON messages, one a line, from the stdout of the CLI named `cli`; blank lines are
/// passed over.
pub struct JsonLines<R> {
    lines: LineReader<R>,
    cli: &'static str,
}

impl<R: AsyncRead + Unpin> JsonLines<R> {
    pub fn new(stdout: R, cli: &'static str) -> Self {
        Self {
            lines: LineReader::with_max(stdout, MAX_LINE),
            cli,
        }
    }

    pub async fn next(&mut self) -> Line {
        let cli = self.cli;
        loop {
            return match self.lines.next_line().await {
                Ok(Some(line)) if line.iter().all(u8::is_ascii_whitespace) => continue,
                Ok(Some(line)) => match serde_json::from_slice::<Value>(&line) {
                    Ok(message) => Line::Message(message),
                    Err(e) => {
                        let shown = String::from_utf8_lossy(&line[..line.len().min(200)]);
                        Line::Invalid(format!(
                            "{cli} wrote a line that is not JSON ({e}): {shown}"
                        ))
                    }
                },
                Ok(None) => Line::End(None),
                Err(FramingError::LineTooLong { len }) => Line::Invalid(format!(
                    "{cli} wrote a line of {len} bytes, over the limit of {MAX_LINE}; it was skipped"
                )),
                Err(FramingError::Io(e)) => Line::End(Some(e.to_string())),
            };
        }
    }

    /// The next message; `None` at the end of the output, a line that is not a message
    /// passed over (a catalog probe looks only for its answer).
    pub async fn next_message(&mut self) -> Option<Value> {
        loop {
            match self.next().await {
                Line::Message(message) => return Some(message),
                Line::Invalid(_) => {}
                Line::End(_) => return None,
            }
        }
    }
}

type Reply = oneshot::Sender<Result<Value, String>>;

/// The requests written to the CLI that wait for their answer, by the id each was sent
/// under (`agentry_<n>`).
pub struct Pending {
    waiting: Mutex<HashMap<String, Reply>>,
    next: AtomicU64,
}

impl Default for Pending {
    fn default() -> Self {
        Self {
            waiting: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        }
    }
}

impl Pending {
    /// A fresh request id.
    pub fn next_id(&self) -> String {
        format!("agentry_{}", self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Write `message`, the request `id` called `name` (for the errors), and wait at most
    /// `timeout` for its answer.
    pub async fn ask(
        &self,
        writer: &LineWriter,
        id: String,
        name: &str,
        message: &Value,
        timeout: Duration,
    ) -> Result<Value, ProviderError> {
        let (tx, rx) = oneshot::channel();
        lock(&self.waiting).insert(id.clone(), tx);
        if writer.send(message).await.is_err() {
            lock(&self.waiting).remove(&id);
            return Err(ProviderError::Gone);
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(Ok(answer))) => Ok(answer),
            Ok(Ok(Err(error))) => Err(ProviderError::Protocol(format!(
                "`{name}` was refused: {error}"
            ))),
            Ok(Err(_)) => Err(ProviderError::Gone),
            Err(_) => {
                lock(&self.waiting).remove(&id);
                Err(ProviderError::Protocol(format!(
                    "`{name}` got no answer within {} s",
                    timeout.as_secs()
                )))
            }
        }
    }

    /// Hand the answer to request `id` to whoever waits for it; `Err(result)` when nobody
    /// does.
    pub fn answer(
        &self,
        id: &str,
        result: Result<Value, String>,
    ) -> Result<(), Result<Value, String>> {
        match lock(&self.waiting).remove(id) {
            Some(reply) => {
                let _ = reply.send(result);
                Ok(())
            }
            None => Err(result),
        }
    }

    /// Nobody will answer what is still waiting: it fails as `Gone`.
    pub fn clear(&self) {
        lock(&self.waiting).clear();
    }
}
