//! The adapter's side of the event sink, shared by every adapter: events go out until the
//! session's last one (`Exited`), and nothing after it.

use tokio::sync::Mutex;

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
