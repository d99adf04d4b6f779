//! What every adapter's session shares: the event sink, through which events go out
//! until the session's last one (`Exited`) and nothing after it, and the handshake that
//! stops the session's supervisor.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::{Mutex, oneshot};

use super::{Ask, EventSink, PermissionDecision, PermissionRequest, ProviderEvent};

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

    /// Ask a person `ask` about the provider's request `provider_request_id`; the receiver
    /// gets the decision (or an error once nobody can answer any more).
    pub async fn ask(
        &self,
        provider_request_id: String,
        ask: Ask,
    ) -> oneshot::Receiver<PermissionDecision> {
        let (reply, decision) = oneshot::channel();
        let Ask {
            kind,
            title,
            call_id,
            input,
            options,
        } = ask;
        self.emit(ProviderEvent::PermissionRequested(PermissionRequest {
            provider_request_id,
            kind,
            title,
            call_id,
            input,
            options,
            reply,
        }))
        .await;
        decision
    }

    /// The session's model becomes `model`: when that changes `current`, record it there
    /// and report it. Whether it changed.
    pub async fn model_changed(&self, current: &mut Option<String>, model: &str) -> bool {
        if current.as_deref() == Some(model) {
            return false;
        }
        *current = Some(model.to_owned());
        let model = model.to_owned();
        self.emit(ProviderEvent::ModelChanged { model }).await;
        true
    }

    /// The session's mode becomes `mode`: when that changes `current`, record it there and
    /// report it. Whether it changed.
    pub async fn mode_changed(&self, current: &mut String, mode: &str) -> bool {
        if current == mode {
            return false;
        }
        mode.clone_into(current);
        let mode = mode.to_owned();
        self.emit(ProviderEvent::ModeChanged { mode }).await;
        true
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
/// description to the waiting `Stopper`, then — only when the session was handed out —
/// report it as the session's last event. A session that never started reports nothing:
/// its failure is the answer to `start`.
pub async fn report_exit(events: &Emitter, report: Reporting, reason: String, agent: &'static str) {
    tracing::debug!(%reason, agent, "agent process ended");
    let _ = report.done.send(reason.clone());
    if report.started.await.is_err() {
        events.close().await;
        return;
    }
    events
        .exited(reason, report.closing.load(Ordering::Acquire))
        .await;
}

/// The session handle's way to stop its supervisor: mark the session as closing (so the
/// exit reads "closed"), ask the supervisor to stop the process, and wait for its exit
/// description. It also tells the supervisor that the session was handed out. Every
/// adapter's supervisor takes the other ends (`StopSignals`). Dropping it (with the
/// session handle) marks the session as closing and stops the process too.
pub struct Stopper {
    close: Option<oneshot::Sender<()>>,
    done: Option<oneshot::Receiver<String>>,
    started: Option<oneshot::Sender<()>>,
    closing: Arc<AtomicBool>,
}

/// The supervisor's ends of a `Stopper`.
pub struct StopSignals {
    /// Fires (or is dropped) when the process is to be stopped.
    pub close: oneshot::Receiver<()>,
    pub report: Reporting,
}

/// Where the supervisor reports the end of its process.
pub struct Reporting {
    /// Takes the exit's description once the process is gone.
    pub done: oneshot::Sender<String>,
    /// Resolves once the session is handed out; dropped if it never is (then no event).
    pub started: oneshot::Receiver<()>,
    /// The session is being closed on purpose (the exit then reads "closed").
    pub closing: Arc<AtomicBool>,
}

impl Stopper {
    pub fn new() -> (Self, StopSignals) {
        let (close_tx, close) = oneshot::channel();
        let (done, done_rx) = oneshot::channel();
        let (started_tx, started) = oneshot::channel();
        let closing = Arc::new(AtomicBool::new(false));
        (
            Self {
                close: Some(close_tx),
                done: Some(done_rx),
                started: Some(started_tx),
                closing: closing.clone(),
            },
            StopSignals {
                close,
                report: Reporting {
                    done,
                    started,
                    closing,
                },
            },
        )
    }

    /// The session is handed out: from now on its end is reported as its last event.
    pub fn handed_out(&mut self) {
        if let Some(started) = self.started.take() {
            let _ = started.send(());
        }
    }

    /// Stop the process and return how it ended ("" when the supervisor was gone). A
    /// session stopped before it was handed out reports no event.
    pub async fn stop(&mut self) -> String {
        self.started.take();
        self.closing.store(true, Ordering::Release);
        if let Some(close) = self.close.take() {
            let _ = close.send(());
        }
        match self.done.take() {
            Some(done) => done.await.unwrap_or_default(),
            None => String::new(),
        }
    }
}

impl Drop for Stopper {
    fn drop(&mut self) {
        // Before the close sender goes (which ends the supervisor's wait).
        self.closing.store(true, Ordering::Release);
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
