//! The live session.

use super::*;

pub(super) struct AcpSession {
    pub(super) session_id: String,
    pub(super) connection: acp::v1::ConnectionTo<acp::Agent>,
    pub(super) shared: Arc<Shared>,
    pub(super) stopper: Stopper,
}

impl AcpSession {
    fn is_gone(&self) -> bool {
        self.connection.termination().is_some() || self.connection.is_incoming_closed()
    }
}

#[async_trait]
impl ProviderSession for AcpSession {
    async fn prompt(&mut self, input: TurnInput) -> Result<(), ProviderError> {
        if self.is_gone() {
            return Err(ProviderError::Gone);
        }
        if self.shared.turn_active.swap(true, Ordering::AcqRel) {
            return Err(ProviderError::Protocol(
                "a turn is already running".to_owned(),
            ));
        }
        self.shared.interrupted.store(false, Ordering::Release);
        let request = proto::PromptRequest::new(
            self.session_id.clone(),
            vec![proto::ContentBlock::Text(proto::TextContent::new(
                input.text,
            ))],
        );
        // Sent untyped so that fields outside the stable schema (usage) are kept.
        let request = match UntypedMessage::new("session/prompt", request) {
            Ok(request) => request,
            Err(e) => {
                self.shared.turn_active.store(false, Ordering::Release);
                return Err(ProviderError::Protocol(e.message));
            }
        };
        let shared = self.shared.clone();
        let sent = self
            .connection
            .prepare_request(request)
            .on_receiving_result(move |result| async move {
                shared.turn_active.store(false, Ordering::Release);
                lock(&shared.tools).calls.clear();
                if let Some(event) = turn_end(result, shared.interrupted.load(Ordering::Acquire)) {
                    shared.events.emit(event).await;
                }
                Ok(())
            });
        sent.map_err(|e| {
            self.shared.turn_active.store(false, Ordering::Release);
            request_error("session/prompt failed", &e)
        })
    }

    async fn interrupt(&mut self) -> Result<(), ProviderError> {
        self.shared.interrupted.store(true, Ordering::Release);
        let sent = self
            .connection
            .send_notification(proto::CancelNotification::new(self.session_id.clone()));
        // The protocol wants every pending permission request answered `cancelled`.
        self.shared
            .permission_epoch
            .send_modify(|epoch| *epoch += 1);
        sent.map_err(|e| request_error("session/cancel failed", &e))
    }

    async fn set_mode(&mut self, mode: &str) -> Result<(), ProviderError> {
        change_mode(&self.connection, &self.shared, &self.session_id, mode).await
    }

    async fn set_model(&mut self, model: &str) -> Result<(), ProviderError> {
        let option = lock(&self.shared.config).model_option.clone();
        let Some(option) = option else {
            return set_model_request(&self.connection, &self.shared, &self.session_id, model)
                .await;
        };
        change_model(
            &self.connection,
            &self.shared,
            &self.session_id,
            &option,
            model,
        )
        .await
    }

    async fn close(mut self: Box<Self>) {
        self.stopper.stop().await;
    }
}
