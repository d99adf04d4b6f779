//! Inbound messages: session updates and permission requests.

use super::*;

/// Claims `session/update` notifications and `session/request_permission` requests. Both
/// are read leniently from the raw JSON so that an agent's extra or unusual fields never
/// cost an event.
pub(super) struct InboundHandler {
    pub(super) shared: Arc<Shared>,
}

impl HandleDispatchFrom<acp::Agent> for InboundHandler {
    async fn handle_dispatch_from(
        &mut self,
        message: Dispatch,
        connection: acp::ConnectionTo<acp::Agent>,
    ) -> Result<Handled<Dispatch>, acp::Error> {
        match message {
            Dispatch::Notification(notification) if notification.method == "session/update" => {
                // Only an update the gate did not count reaches the SDK (see `gate`): no
                // credit to give back.
                self.shared.updates_seen.fetch_add(1, Ordering::AcqRel);
                let (_, params) = notification.into_parts();
                self.on_session_update(params).await;
                Ok(Handled::Yes)
            }
            Dispatch::Request(request, responder)
                if request.method == "session/request_permission" =>
            {
                let (_, params) = request.into_parts();
                self.on_permission_request(params, responder, &connection)
                    .await;
                Ok(Handled::Yes)
            }
            other => Ok(Handled::No {
                message: other,
                retry: false,
            }),
        }
    }

    fn describe_chain(&self) -> impl std::fmt::Debug {
        "agentry ACP session handler"
    }
}

impl InboundHandler {
    pub(super) async fn on_session_update(&self, mut params: Value) {
        if self.shared.replaying.load(Ordering::Acquire) {
            return;
        }
        let Some(update) = params.get_mut("update").and_then(Value::as_object_mut) else {
            tracing::trace!("session/update without an update");
            return;
        };
        let tag = match update.get("sessionUpdate").and_then(Value::as_str) {
            Some(tag) => UpdateTag::of(tag),
            None => UpdateTag::Other,
        };
        let event = match tag {
            UpdateTag::MessageChunk | UpdateTag::ThoughtChunk => {
                let Some(text) = take_text_chunk(update) else {
                    return;
                };
                let id = take_string(update.get_mut("messageId"));
                if tag == UpdateTag::MessageChunk {
                    ProviderEvent::AssistantDelta {
                        message_id: id,
                        text,
                    }
                } else {
                    ProviderEvent::ReasoningDelta { id, text }
                }
            }
            UpdateTag::ToolCall | UpdateTag::ToolCallUpdate => {
                let replace = tag == UpdateTag::ToolCall;
                let Some((call, _)) = lock(&self.shared.tools).apply(update, replace) else {
                    tracing::trace!("tool call update without a toolCallId");
                    return;
                };
                ProviderEvent::ToolCall(call)
            }
            UpdateTag::Plan => {
                let entries = update
                    .get("entries")
                    .and_then(Value::as_array)
                    .map(|entries| {
                        entries
                            .iter()
                            .filter_map(|entry| {
                                Some(PlanEntry {
                                    text: entry.get("content")?.as_str()?.to_owned(),
                                    status: PlanStatus::parse(
                                        entry
                                            .get("status")
                                            .and_then(Value::as_str)
                                            .unwrap_or("pending"),
                                    ),
                                })
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                ProviderEvent::Plan { entries }
            }
            UpdateTag::ModeUpdate => {
                let Some(mode) = update
                    .get("currentModeId")
                    .or_else(|| update.get("modeId"))
                    .and_then(Value::as_str)
                else {
                    return;
                };
                let Some(mode) = lock(&self.shared.config).mode_reported(mode) else {
                    return;
                };
                if self.shared.starting.load(Ordering::Acquire) {
                    return;
                }
                ProviderEvent::ModeChanged { mode }
            }
            UpdateTag::ConfigUpdate => {
                let options = update
                    .get("configOptions")
                    .and_then(|v| Vec::<proto::SessionConfigOption>::deserialize(v).ok())
                    .unwrap_or_default();
                let changes = {
                    let mut config = lock(&self.shared.config);
                    let changes = config.absorb_options(&options);
                    if changes.mode.is_some() {
                        config.mode_reports += 1;
                    }
                    if changes.model.is_some() {
                        config.model_reports += 1;
                    }
                    changes
                };
                if self.shared.starting.load(Ordering::Acquire) {
                    return;
                }
                if let Some(mode) = changes.mode {
                    self.shared
                        .events
                        .emit(ProviderEvent::ModeChanged { mode })
                        .await;
                }
                match changes.model {
                    Some(model) => ProviderEvent::ModelChanged { model },
                    None => return,
                }
            }
            UpdateTag::Usage => {
                let used = update.get("used").and_then(Value::as_u64);
                let size = update.get("size").and_then(Value::as_u64);
                let cost = update.get("cost").and_then(|cost| {
                    let currency = cost.get("currency").and_then(Value::as_str);
                    if currency.is_none_or(|c| c.eq_ignore_ascii_case("usd")) {
                        cost.get("amount").and_then(Value::as_f64)
                    } else {
                        None
                    }
                });
                ProviderEvent::Usage(Usage {
                    context_window_used: used,
                    context_window_max: size,
                    cost_usd: cost,
                    ..Usage::default()
                })
            }
            UpdateTag::UserChunk | UpdateTag::Other => {
                tracing::trace!(kind = ?update.get("sessionUpdate"), "session update ignored");
                return;
            }
        };
        self.shared.events.emit(event).await;
    }

    async fn on_permission_request(
        &self,
        mut params: Value,
        responder: acp::Responder<Value>,
        connection: &acp::ConnectionTo<acp::Agent>,
    ) {
        // Nobody is asked during a history replay, nor after the turn was interrupted.
        if self.shared.replaying.load(Ordering::Acquire)
            || self.shared.interrupted.load(Ordering::Acquire)
        {
            let _ = responder.respond(permission_outcome(None));
            return;
        }
        let offered = params
            .get("options")
            .and_then(Value::as_array)
            .map(|options| permission_options(options))
            .unwrap_or_default();
        let mut call = match params.get_mut("toolCall").map(Value::take) {
            Some(Value::Object(call)) => call,
            _ => Map::new(),
        };
        let call_id = call.get("toolCallId").and_then(id_string);
        let mut title = call.get("title").and_then(Value::as_str).map(str::to_owned);
        let mut input = call.get("rawInput").filter(|v| !v.is_null()).cloned();
        // Some agents (Gemini) announce the tool call only here: report it first.
        let tool_update = {
            let mut tools = lock(&self.shared.tools);
            tools.keep_announced_input(&mut call);
            tools.apply(&mut call, false)
        };
        if let Some((update, changed)) = tool_update {
            // What the request leaves out, the earlier `tool_call` may have said.
            if title.is_none() && update.title != update.name {
                title = Some(update.title.clone());
            }
            if input.is_none() && update.input.as_object().is_none_or(|o| !o.is_empty()) {
                input = Some(update.input.clone());
            }
            if changed {
                self.shared
                    .events
                    .emit(ProviderEvent::ToolCall(update))
                    .await;
            }
        }
        if offered.is_empty() {
            tracing::warn!("permission request without usable options; answering cancelled");
            let _ = responder.respond(permission_outcome(None));
            return;
        }

        let mut epoch = self.shared.permission_epoch.subscribe();
        let asked_at = *epoch.borrow_and_update();
        let ask = Ask {
            kind: PermissionKind::Tool,
            title: title.unwrap_or_else(|| "Permission requested".to_owned()),
            call_id,
            input,
            options: offered.iter().map(|(option, _)| option.clone()).collect(),
        };
        let decision = self
            .shared
            .events
            .ask(responder.raw_id().to_string(), ask)
            .await;

        // Wait for the answer off the dispatch loop: updates keep flowing meanwhile.
        let waiting = async move {
            let chosen = tokio::select! {
                decision = decision => match decision {
                    Ok(PermissionDecision::Selected { option_id, behavior, .. }) => {
                        provider_option(&offered, &option_id, behavior)
                    }
                    Ok(PermissionDecision::Cancelled) | Err(_) => None,
                },
                _ = epoch.wait_for(|now| *now != asked_at) => None,
            };
            let _ = responder.respond(permission_outcome(chosen));
            Ok(())
        };
        if let Err(e) = connection.spawn(waiting) {
            tracing::warn!(error = %e.message, "could not wait for a permission answer");
        }
    }
}
