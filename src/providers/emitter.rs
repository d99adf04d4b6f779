//! What every adapter's session shares: the event sink, through which events go out
//! until the session's last one (`Exited`) and nothing after it, and the handshake that
//! stops the session's supervisor.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::{Mutex, oneshot};

use super::{EventSink, ProviderEvent};

pub struct Emitter {
    sink: Mutex<Option<EventSink>>,
}

impl Emitter {
    pub fn new(sink: EventSink) -> Self {
        Self {
            sink: Mutex::new(Some(sink)),
        }
    }

    pub async fn emit(&self, event: ProviderEvent) {
        let guard = self.sink.lock().await;
        if let Some(sink) = guard.as_ref() {
            // A gone receiver means nobody listens any more; that is not our failure.
            let _ = sink.send(event).await;
        }
    }

    /// Send the last event.
    pub async fn finish(&self, event: ProviderEvent) {
        let sink = self.sink.lock().await.take();
        if let Some(sink) = sink {
            let _ = sink.send(event).await;
        }
    }

    /// The process is gone: report it as the last event, saying "closed" when the session
    /// was being closed on purpose and the exit's description otherwise.
    pub async fn exited(&self, reason: String, closing: bool) {
        let reason = if closing { "closed".to_owned() } else { reason };
        self.finish(ProviderEvent::Exited { reason }).await;
    }

    /// Stop sending without a last event (the session never started).
    pub async fn close(&self) {
        self.sink.lock().await.take();
    }
}

/// The last thing every supervisor does once its process is reaped: hand the exit's
/// description to the waiting `Stopper`, then — only when the session was handed out
/// (`started` resolves) — report it as the session's last event. A session that never
/// started reports nothing: its failure is the answer to `start`.
pub async fn report_exit(
    events: &Emitter,
    done: oneshot::Sender<String>,
    started: oneshot::Receiver<()>,
    reason: String,
    closing: &AtomicBool,
    agent: &'static str,
) {
    tracing::debug!(%reason, agent, "agent process ended");
    let _ = done.send(reason.clone());
    if started.await.is_err() {
        events.close().await;
        return;
    }
    events.exited(reason, closing.load(Ordering::Acquire)).await;
}

/// The session handle's way to stop its supervisor: mark the session as closing (so the
/// exit reads "closed"), ask the supervisor to stop the process, and wait for its exit
/// description. Every adapter's supervisor takes the other ends (`close`, `done`).
pub struct Stopper {
    close: Option<oneshot::Sender<()>>,
    done: Option<oneshot::Receiver<String>>,
}

/// The supervisor's ends of a `Stopper`.
pub struct StopSignals {
    /// Fires (or is dropped) when the process is to be stopped.
    pub close: oneshot::Receiver<()>,
    /// Takes the exit's description once the process is gone.
    pub done: oneshot::Sender<String>,
}

impl Stopper {
    pub fn new() -> (Self, StopSignals) {
        let (close_tx, close) = oneshot::channel();
        let (done, done_rx) = oneshot::channel();
        (
            Self {
                close: Some(close_tx),
                done: Some(done_rx),
            },
            StopSignals { close, done },
        )
    }

    /// Stop the process and return how it ended ("" when the supervisor was gone).
    pub async fn stop(&mut self, closing: &AtomicBool) -> String {
        closing.store(true, Ordering::Release);
        if let Some(close) = self.close.take() {
            let _ = close.send(());
        }
        match self.done.take() {
            Some(done) => done.await.unwrap_or_default(),
            None => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn nothing_goes_out_after_the_last_event() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        let emitter = Emitter::new(tx);
        emitter
            .emit(ProviderEvent::Error {
                message: "a".into(),
                code: None,
            })
            .await;
        emitter
            .exited("the agent process exited".into(), true)
            .await;
        emitter
            .emit(ProviderEvent::Error {
                message: "late".into(),
                code: None,
            })
            .await;
        assert!(matches!(rx.recv().await, Some(ProviderEvent::Error { .. })));
        assert!(
            matches!(rx.recv().await, Some(ProviderEvent::Exited { reason }) if reason == "closed")
        );
        assert!(
            rx.recv().await.is_none(),
            "the sink is dropped after the last event"
        );
    }
}
