//! What every adapter does with a child's stderr and its end: keep the last bytes for
//! error messages (logging each line at debug), and describe an exit in one sentence.

use std::collections::VecDeque;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::task::JoinHandle;

use crate::domain::Redactor;

/// Bytes of stderr kept for error messages.
const RING_BYTES: usize = 8 * 1024;
/// Lines of stderr quoted in an exit reason.
const TAIL_LINES: usize = 5;
/// How long to wait for the last stderr bytes once the process is gone.
const FLUSH: Duration = Duration::from_millis(500);

/// The last stderr bytes of a child, filled by a task that reads its stderr to the end.
#[derive(Clone, Default)]
pub struct StderrTail {
    ring: Arc<Mutex<Ring>>,
    /// The child's secret values, masked in the lines logged and in the tail.
    redactor: Redactor,
}

/// The task reading a child's stderr; `settle` waits briefly for its last bytes.
pub struct StderrReader(JoinHandle<()>);

impl StderrReader {
    pub async fn settle(self) {
        let _ = tokio::time::timeout(FLUSH, self.0).await;
    }
}

impl StderrTail {
    /// Read `stderr` to its end in a task, logging each line at debug with `source`.
    pub fn capture<R>(stderr: R, source: &'static str) -> (Self, StderrReader)
    where
        R: AsyncRead + Unpin + Send + 'static,
    {
        Self::capture_masked(stderr, source, Redactor::default())
    }

    /// Like `capture`, with the child's secret values (`ManagedChild::redactor`) masked.
    pub fn capture_masked<R>(
        stderr: R,
        source: &'static str,
        redactor: Redactor,
    ) -> (Self, StderrReader)
    where
        R: AsyncRead + Unpin + Send + 'static,
    {
        let tail = Self {
            ring: Default::default(),
            redactor,
        };
        let task = tokio::spawn(drain(stderr, tail.clone(), source));
        (tail, StderrReader(task))
    }

    /// The last few non-empty lines.
    pub fn tail(&self) -> String {
        let tail = self.lock().tail(TAIL_LINES);
        self.redactor.text(&tail).into_owned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Default)]
struct Ring {
    bytes: VecDeque<u8>,
}

impl Ring {
    fn push(&mut self, chunk: &[u8]) {
        let chunk = &chunk[chunk.len().saturating_sub(RING_BYTES)..];
        let overflow = (self.bytes.len() + chunk.len()).saturating_sub(RING_BYTES);
        self.bytes.drain(..overflow);
        self.bytes.extend(chunk);
    }

    /// The last `lines` non-empty lines.
    fn tail(&self, lines: usize) -> String {
        let (a, b) = self.bytes.as_slices();
        let mut raw = Vec::with_capacity(a.len() + b.len());
        raw.extend_from_slice(a);
        raw.extend_from_slice(b);
        let text = String::from_utf8_lossy(&raw);
        let mut tail: Vec<&str> = text
            .lines()
            .map(str::trim_end)
            .filter(|l| !l.trim().is_empty())
            .rev()
            .take(lines)
            .collect();
        tail.reverse();
        tail.join("\n")
    }
}

async fn drain<R: AsyncRead + Unpin>(mut stderr: R, tail: StderrTail, source: &'static str) {
    let mut buf = vec![0u8; 4096];
    let mut line = Vec::new();
    loop {
        let n = match stderr.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        tail.lock().push(&buf[..n]);
        for &byte in &buf[..n] {
            if byte == b'\n' {
                tracing::debug!(target: "agentry::process::stderr", source, "{}", tail.redactor.text(&String::from_utf8_lossy(&line)));
                line.clear();
            } else if line.len() < 4096 {
                line.push(byte);
            }
        }
    }
    if !line.is_empty() {
        tracing::debug!(target: "agentry::process::stderr", source, "{}", tail.redactor.text(&String::from_utf8_lossy(&line)));
    }
}

/// One sentence on how an agent process ended: its exit status (or why the connection
/// broke), then the last lines it wrote to stderr.
pub fn describe_exit(
    status: Option<ExitStatus>,
    broken: Option<&str>,
    stderr_tail: &str,
) -> String {
    let mut reason = match (status, broken) {
        (Some(status), _) => match (status.signal(), status.code()) {
            (Some(signal), _) => format!("the agent process was killed by signal {signal}"),
            (None, Some(0)) => "the agent process exited".to_owned(),
            (None, Some(code)) => format!("the agent process exited with status {code}"),
            (None, None) => "the agent process ended".to_owned(),
        },
        (None, Some(error)) => format!("the connection to the agent broke: {error}"),
        (None, None) => "the agent process ended".to_owned(),
    };
    if !stderr_tail.is_empty() {
        reason.push_str("; last stderr:\n");
        reason.push_str(stderr_tail);
    }
    reason
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_last_lines() {
        let mut ring = Ring::default();
        for i in 0..5000 {
            ring.push(format!("line {i}\n").as_bytes());
        }
        assert!(ring.bytes.len() <= RING_BYTES);
        assert_eq!(ring.tail(2), "line 4998\nline 4999");
    }

    #[tokio::test]
    async fn capture_reads_to_the_end() {
        let (tail, reader) = StderrTail::capture(&b"one\n\ntwo\nthree"[..], "test");
        reader.settle().await;
        assert_eq!(tail.tail(), "one\ntwo\nthree");
    }

    #[tokio::test]
    async fn secret_values_are_masked_in_the_tail() {
        let env = crate::domain::SecretEnv::from([(
            "K".to_owned(),
            crate::domain::SecretValue::new("sk-hidden"),
        )]);
        let (tail, reader) = StderrTail::capture_masked(
            &b"error: bad key sk-hidden\n"[..],
            "test",
            Redactor::new(&env),
        );
        reader.settle().await;
        assert_eq!(tail.tail(), "error: bad key [redacted]");
    }

    #[test]
    fn exits_are_described_with_the_stderr_tail() {
        let killed = ExitStatus::from_raw(9);
        assert_eq!(
            describe_exit(Some(killed), None, "boom"),
            "the agent process was killed by signal 9; last stderr:\nboom"
        );
        assert_eq!(
            describe_exit(None, Some("EOF"), ""),
            "the connection to the agent broke: EOF"
        );
    }
}
