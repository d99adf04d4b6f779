//! The write side of an NDJSON conversation with a child: each message is serialized,
//! ended with `\n` and flushed as one write, so that concurrent senders never interleave.
//! Cloneable; once a write fails (the process closed its stdin or is gone) every later
//! send fails at once.

use std::sync::Arc;

use serde::Serialize;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Mutex;

#[derive(Debug, thiserror::Error)]
pub enum LineWriterError {
    #[error("the process no longer reads its input")]
    Closed,
    #[error("the message could not be serialized: {0}")]
    Serialize(#[from] serde_json::Error),
}

type Sink = Box<dyn AsyncWrite + Send + Unpin>;

/// A shared NDJSON writer for a child's stdin.
#[derive(Clone)]
pub struct LineWriter {
    sink: Arc<Mutex<Option<Sink>>>,
}

impl LineWriter {
    pub fn new<W: AsyncWrite + Send + Unpin + 'static>(writer: W) -> Self {
        Self {
            sink: Arc::new(Mutex::new(Some(Box::new(writer)))),
        }
    }

    /// Write `message` as one JSON line and flush it.
    pub async fn send<T: Serialize + ?Sized>(&self, message: &T) -> Result<(), LineWriterError> {
        // serde_json escapes control characters inside strings, so the line holds no `\n`.
        let mut line = serde_json::to_vec(message)?;
        line.push(b'\n');
        let mut guard = self.sink.lock().await;
        let Some(sink) = guard.as_mut() else {
            return Err(LineWriterError::Closed);
        };
        let written = async {
            sink.write_all(&line).await?;
            sink.flush().await
        }
        .await;
        if written.is_err() {
            // A broken pipe stays broken: later sends fail without trying.
            *guard = None;
            return Err(LineWriterError::Closed);
        }
        Ok(())
    }

    /// Close the child's stdin (it sees end of input); later sends fail.
    pub async fn close(&self) {
        let taken = self.sink.lock().await.take();
        if let Some(mut sink) = taken {
            let _ = sink.shutdown().await;
        }
    }

    pub async fn is_closed(&self) -> bool {
        self.sink.lock().await.is_none()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tokio::io::AsyncReadExt;

    use super::*;

    #[tokio::test]
    async fn messages_are_whole_lines() {
        let (tx, mut rx) = tokio::io::duplex(4096);
        let writer = LineWriter::new(tx);
        let other = writer.clone();
        let a = tokio::spawn(async move {
            for i in 0..50 {
                writer.send(&json!({"a": i, "text": "x\ny"})).await.unwrap();
            }
        });
        let b = tokio::spawn(async move {
            for i in 0..50 {
                other.send(&json!({"b": i})).await.unwrap();
            }
            other
        });
        a.await.unwrap();
        let other = b.await.unwrap();
        other.close().await;
        let mut out = String::new();
        rx.read_to_string(&mut out).await.unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 100);
        for line in lines {
            serde_json::from_str::<serde_json::Value>(line).expect("each line is one message");
        }
    }

    #[tokio::test]
    async fn a_gone_reader_fails_every_send() {
        let (tx, rx) = tokio::io::duplex(64);
        drop(rx);
        let writer = LineWriter::new(tx);
        assert!(matches!(
            writer.send(&json!({"x": 1})).await,
            Err(LineWriterError::Closed)
        ));
        assert!(writer.is_closed().await);
        assert!(matches!(
            writer.send(&json!({"x": 2})).await,
            Err(LineWriterError::Closed)
        ));
    }
}
