//! The supervisor of every adapter's process: it owns the agent's process once the
//! session is set up, waits for it to end (or for the session to be closed, or for its
//! output to break), winds it down, and reports how it ended — to the `Stopper` waiting on
//! `done` and, only when the session was handed out, as the session's last event.
//!
//! An adapter's own `supervise` says what is particular to it: what it reads while it
//! waits ([`watch`]), what stopping means (closing the process' stdin, say) and what must
//! happen once the process is gone ([`Exit::report`]).

use std::future::Future;
use std::process::ExitStatus;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::emitter::{Emitter, Reporting, report_exit};
use crate::process::ManagedChild;
use crate::process::output::{StderrReader, StderrTail, describe_exit};

/// How the wait for a process ended.
#[derive(Debug, Default)]
pub struct Ending {
    /// How the process exited, when it did while it was watched.
    pub status: Option<ExitStatus>,
    /// Why its output could no longer be followed, when it could not.
    pub broken: Option<String>,
    /// The process is stopped because of `broken`, and that — not how the stop ended the
    /// process — is how it ended.
    pub lost: bool,
}

/// Wait until the process exits, `close` resolves, or `output` ends: `output` is the
/// adapter's reading of what the process writes, resolving at the end of that output with
/// why it broke, if it did. After an exit, `output` has `drain` to read what the process
/// wrote before it ended. `output` is dropped before this returns.
pub async fn watch<O, C>(child: &mut ManagedChild, output: O, drain: Duration, close: C) -> Ending
where
    O: Future<Output = Option<String>>,
    C: Future,
{
    let mut output = std::pin::pin!(output);
    let mut ending = Ending::default();
    tokio::select! {
        broken = &mut output => ending.broken = broken,
        waited = child.wait() => {
            ending.status = waited.ok();
            if let Ok(broken) = tokio::time::timeout(drain, &mut output).await {
                ending.broken = broken;
            }
        }
        _ = close => {}
    }
    ending
}

/// Let a task that handles what the process wrote finish, for at most `within`; then
/// abort it.
pub async fn drain(mut task: JoinHandle<()>, within: Duration) {
    if tokio::time::timeout(within, &mut task).await.is_err() {
        task.abort();
    }
}

/// Where a supervisor reports the end of its process.
pub struct Exit<'a> {
    /// The adapter, for the log.
    agent: &'static str,
    events: &'a Emitter,
    /// The last lines the process wrote to stderr, for the description of its end.
    stderr: &'a StderrTail,
}

impl<'a> Exit<'a> {
    pub fn new(agent: &'static str, events: &'a Emitter, stderr: &'a StderrTail) -> Self {
        Self {
            agent,
            events,
            stderr,
        }
    }

    /// Wind the process down — after its stdin is closed it has `after_eof` to exit on its
    /// own, then what is left of its group is stopped — run `reaped` (what must happen
    /// once it is gone), let `readers` (of its stderr, and of any other output kept only
    /// for the log) read to the end, and report how it ended to `report`.
    pub async fn report<F>(
        self,
        mut child: ManagedChild,
        ending: Ending,
        readers: Vec<StderrReader>,
        report: Reporting,
        after_eof: Duration,
        reaped: F,
    ) where
        F: Future<Output = ()>,
    {
        let status = child.wind_down(ending.status, after_eof).await;
        reaped.await;
        for reader in readers {
            reader.settle().await;
        }
        let status = if ending.lost { None } else { status };
        let reason = describe_exit(status, ending.broken.as_deref(), &self.stderr.tail());
        report_exit(self.events, report, reason, self.agent).await;
    }
}

/// The last lines a process wrote (`what` says where), to end a message with; empty when
/// it wrote none.
pub fn tail_suffix(what: &str, tail: &StderrTail) -> String {
    let tail = tail.tail();
    if tail.is_empty() {
        String::new()
    } else {
        format!("; last {what}:\n{tail}")
    }
}
