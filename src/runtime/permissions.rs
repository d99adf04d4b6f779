//! The permission requests an agent's actor holds open, and the rules for answering them:
//! a request is pending from the moment it is stored until it is answered (the provider
//! hears the chosen option), expires with its turn (the provider hears "cancelled"), or
//! is withdrawn by the provider (nobody is told). An answer to a request that is no
//! longer pending is refused with the reason its stored row gives.
//!
//! `Permissions` is that state machine, with unit tests below; the `impl Actor` here is
//! the actor's side of it: storing a request before it is announced, writing an answer
//! before the provider hears it, and moving the agent between `running` and
//! `waiting_permission`.

use std::collections::HashMap;

use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::actor::Actor;
use super::{Moment, PermissionAnswer, RuntimeError, Shared};
use crate::domain::{AgentId, AgentStatus, Behavior, EventKind, PermissionId, PermissionOption};
use crate::events::Attached;
use crate::providers::{PermissionDecision, PermissionRequest};
use crate::store;

struct Pending {
    reply: oneshot::Sender<PermissionDecision>,
    options: Vec<PermissionOption>,
}

/// The open requests of one agent, owned by its actor.
#[derive(Default)]
pub(crate) struct Permissions {
    open: HashMap<PermissionId, Pending>,
}

/// A request taken out of the pending set to be answered; the provider hears the answer
/// once `selected` is called (after the answer is durable). Dropped unanswered, the
/// provider's wait ends without a decision.
pub(crate) struct Answering {
    reply: oneshot::Sender<PermissionDecision>,
}

impl Answering {
    /// Tell the provider which option was chosen.
    pub(crate) fn selected(self, option: PermissionOption, answer: PermissionAnswer) {
        // A provider that stopped waiting has dropped its receiver: nothing to tell.
        let _ = self.reply.send(PermissionDecision::Selected {
            option_id: option.id,
            behavior: answer.behavior,
            message: answer.message,
            updated_input: answer.updated_input,
        });
    }
}

impl Permissions {
    /// Whether no request waits for an answer.
    pub(crate) fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// A stored request now waits for an answer; `reply` is how the provider hears it.
    pub(crate) fn open(
        &mut self,
        id: PermissionId,
        reply: oneshot::Sender<PermissionDecision>,
        options: Vec<PermissionOption>,
    ) {
        self.open.insert(id, Pending { reply, options });
    }

    /// The option `answer` selects for request `id`: `None` when the request is not
    /// pending here (see [`state_error`] for why), else the option or why it is refused.
    /// The request stays pending either way.
    pub(crate) fn choose(
        &self,
        id: PermissionId,
        answer: &PermissionAnswer,
    ) -> Option<Result<PermissionOption, RuntimeError>> {
        let pending = self.open.get(&id)?;
        Some(pick_option(
            &pending.options,
            answer.behavior,
            answer.option_id.as_deref(),
        ))
    }

    /// Take request `id` out of the pending set to answer it; `None` when it is not pending.
    pub(crate) fn answer(&mut self, id: PermissionId) -> Option<Answering> {
        self.open.remove(&id).map(|p| Answering { reply: p.reply })
    }

    /// The request is no longer pending and the provider is not told: it withdrew the
    /// request itself, or another replica answered it first.
    pub(crate) fn forget(&mut self, id: PermissionId) {
        self.open.remove(&id);
    }

    /// The turn ended: every pending request expires, its provider hears "cancelled".
    /// Returns the expired requests.
    pub(crate) fn expire_all(&mut self) -> Vec<PermissionId> {
        self.open
            .drain()
            .map(|(id, p)| {
                let _ = p.reply.send(PermissionDecision::Cancelled);
                id
            })
            .collect()
    }

    /// The actor stops without writing anything more (another replica owns the agent):
    /// the requests are dropped and the provider hears nothing.
    pub(crate) fn abandon(&mut self) {
        self.open.clear();
    }
}

/// What is stored of an answer: the behavior, the chosen option, and the answer's
/// message and edited input when given.
pub(crate) fn resolution(option: &PermissionOption, answer: &PermissionAnswer) -> Value {
    let mut resolution = json!({"behavior": answer.behavior, "option_id": option.id});
    if let Some(m) = &answer.message {
        resolution["message"] = json!(m);
    }
    if let Some(u) = &answer.updated_input {
        resolution["updated_input"] = u.clone();
    }
    resolution
}

/// The resolution stored for a request that expired unanswered.
pub(crate) fn expired_resolution() -> Value {
    json!({"behavior": Behavior::Deny, "expired": true})
}

/// The option an answer selects: the named one (whose behavior must match), or the first
/// option of the requested behavior.
pub(crate) fn pick_option(
    options: &[PermissionOption],
    behavior: Behavior,
    option_id: Option<&str>,
) -> Result<PermissionOption, RuntimeError> {
    match option_id {
        Some(id) => {
            let o = options
                .iter()
                .find(|o| o.id == id)
                .ok_or_else(|| RuntimeError::UnknownOption(id.to_owned()))?;
            if o.behavior != behavior {
                return Err(RuntimeError::BehaviorMismatch {
                    option: id.to_owned(),
                    actual: o.behavior.as_str(),
                    requested: behavior.as_str(),
                });
            }
            Ok(o.clone())
        }
        None => options
            .iter()
            .find(|o| o.behavior == behavior)
            .cloned()
            .ok_or(RuntimeError::NoOptionForBehavior(behavior.as_str())),
    }
}

/// Why a request that is not pending in the actor cannot be answered, from its stored
/// status (`None`: no such request of this agent).
pub(crate) fn state_error(stored_status: Option<&str>) -> RuntimeError {
    match stored_status {
        Some("resolved") => RuntimeError::PermissionAlreadyResolved,
        Some(_) => RuntimeError::PermissionExpired("its turn ended before it was answered".into()),
        None => RuntimeError::PermissionNotFound,
    }
}

/// Why a request that is not pending in the actor cannot be answered.
pub(crate) async fn permission_state_error(
    shared: &Shared,
    agent: AgentId,
    id: PermissionId,
) -> RuntimeError {
    match store::permissions::get(&shared.pool, agent.uuid(), id.uuid()).await {
        Ok(row) => state_error(row.as_ref().map(|r| r.status.as_str())),
        Err(e) => RuntimeError::Store(e),
    }
}

/// The actor's side: storing, announcing and answering its requests.
impl Actor {
    /// Answer the pending request `id`: stored first (a request answered elsewhere
    /// meanwhile is refused), then the timeline, then the provider hears the option.
    pub(super) async fn answer(
        &mut self,
        id: PermissionId,
        answer: PermissionAnswer,
    ) -> Result<(), RuntimeError> {
        let Some(option) = self.permissions.choose(id, &answer) else {
            return Err(permission_state_error(&self.shared, self.id(), id).await);
        };
        let option = option?;
        let resolution = resolution(&option, &answer);
        if !store::permissions::resolve(
            &self.shared.pool,
            id.uuid(),
            &resolution,
            answer.resolved_by,
        )
        .await?
        {
            self.permissions.forget(id);
            return Err(RuntimeError::PermissionAlreadyResolved);
        }
        let pending = self.permissions.answer(id).expect("checked above");
        let mut data = json!({
            "request_id": id, "behavior": answer.behavior, "option_id": option.id,
            "resolved_by": crate::domain::UserId::from(answer.resolved_by),
        });
        if let Some(m) = &answer.message {
            data["message"] = json!(m);
        }
        let team = self.team_event(
            "permission_resolved",
            json!({"agent_id": self.id(), "request_id": id, "behavior": answer.behavior}),
        );
        let moment = Moment::PermissionResolved {
            request_id: id,
            resolution: resolution.clone(),
        };
        self.commit_with(
            vec![self.event(EventKind::PermissionResolved, data)],
            Attached {
                fence: None,
                team: vec![team],
                moments: vec![moment.at(0)],
                changes: Vec::new(),
            },
        )
        .await?;
        pending.selected(option, answer);
        if self.permissions.is_empty() && self.in_turn() {
            self.set_status(AgentStatus::Running, None).await?;
        }
        Ok(())
    }

    /// The provider asks: the request is stored, announced, and held open until it is
    /// answered, expires with its turn or is withdrawn. One that cannot be stored is
    /// denied (the provider hears "cancelled").
    pub(super) async fn permission_requested(&mut self, req: PermissionRequest) {
        self.close_message(false).await;
        self.close_message(true).await;
        let id = PermissionId::new();
        let options = json!(req.options);
        let kind = serde_json::to_value(req.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let mut input = req.input.clone();
        if let Some(input) = input.as_mut() {
            self.redactor.json(input);
        }
        let stored = store::permissions::insert(
            &self.shared.pool,
            store::permissions::NewPermission {
                id: id.uuid(),
                agent_id: self.id().uuid(),
                turn_id: self.turn_id().map(|t| t.uuid()),
                provider_request_id: &req.provider_request_id,
                kind: &kind,
                title: &self.redactor.text(&req.title),
                call_id: req.call_id.as_deref(),
                input: input.as_ref(),
                options: &options,
            },
        )
        .await;
        if let Err(e) = stored {
            tracing::error!(agent_id = %self.id(), error = %e, "could not store a permission request; denying it");
            let _ = req.reply.send(PermissionDecision::Cancelled);
            return;
        }
        let mut data =
            json!({"request_id": id, "kind": kind, "title": req.title, "options": options});
        if let Some(c) = &req.call_id {
            data["call_id"] = json!(c);
        }
        if let Some(i) = &req.input {
            data["input"] = i.clone();
        }
        let team = self.team_event(
            "permission_requested",
            json!({"agent_id": self.id(), "request_id": id, "title": req.title}),
        );
        if let Err(e) = self
            .commit_with(
                vec![self.event(EventKind::PermissionRequested, data)],
                Attached {
                    fence: None,
                    team: vec![team],
                    moments: vec![Moment::PermissionRequested { request_id: id }.at(0)],
                    changes: Vec::new(),
                },
            )
            .await
        {
            tracing::error!(error = %e, "could not record a permission request");
        }
        self.permissions.open(id, req.reply, req.options);
        if self.in_turn() {
            let _ = self.set_status(AgentStatus::WaitingPermission, None).await;
        }
    }

    /// The CLI no longer waits for an answer: the request expires, and the timeline says so.
    pub(super) async fn permission_withdrawn(&mut self, provider_request_id: &str) {
        let expired = match store::permissions::expire_by_provider_id(
            &self.shared.pool,
            self.id().uuid(),
            provider_request_id,
        )
        .await
        {
            Ok(Some(id)) => PermissionId::from(id),
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(agent_id = %self.id(), error = %e, "could not expire a withdrawn permission request");
                return;
            }
        };
        self.permissions.forget(expired);
        self.emit(
            EventKind::PermissionResolved,
            json!({"request_id": expired, "behavior": Behavior::Deny, "expired": true,
                   "resolved_by": null, "message": "the agent withdrew the request"}),
        )
        .await;
        self.attach(Moment::PermissionResolved {
            request_id: expired,
            resolution: expired_resolution(),
        });
        if self.permissions.is_empty() && self.in_turn() {
            let _ = self.set_status(AgentStatus::Running, None).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot::error::TryRecvError;
    use uuid::Uuid;

    fn option(id: &str, behavior: Behavior) -> PermissionOption {
        PermissionOption {
            id: id.into(),
            label: id.into(),
            behavior,
        }
    }

    fn options() -> Vec<PermissionOption> {
        vec![
            option("allow_once", Behavior::Allow),
            option("allow_always", Behavior::Allow),
            option("reject_once", Behavior::Deny),
        ]
    }

    fn answer(behavior: Behavior, option_id: Option<&str>) -> PermissionAnswer {
        PermissionAnswer {
            behavior,
            option_id: option_id.map(str::to_owned),
            message: None,
            updated_input: None,
            resolved_by: Uuid::nil(),
        }
    }

    /// A request opened in `set`, with the receiver the provider waits on.
    fn request(set: &mut Permissions) -> (PermissionId, oneshot::Receiver<PermissionDecision>) {
        let (tx, rx) = oneshot::channel();
        let id = PermissionId::new();
        set.open(id, tx, options());
        (id, rx)
    }

    #[test]
    fn an_answered_request_tells_the_provider_the_chosen_option_once() {
        let mut set = Permissions::default();
        let (id, mut rx) = request(&mut set);
        assert!(!set.is_empty());
        let mut a = answer(Behavior::Allow, Some("allow_always"));
        a.message = Some("go ahead".into());
        let option = set.choose(id, &a).expect("pending").expect("valid");
        assert_eq!(option.id, "allow_always");
        // Choosing does not answer: the request stays pending until it is taken.
        assert!(matches!(rx.try_recv(), Err(TryRecvError::Empty)));
        assert_eq!(
            resolution(&option, &a),
            json!({"behavior": "allow", "option_id": "allow_always", "message": "go ahead"})
        );
        set.answer(id).expect("pending").selected(option, a);
        assert!(set.is_empty());
        match rx.try_recv() {
            Ok(PermissionDecision::Selected {
                option_id,
                behavior,
                message,
                updated_input,
            }) => {
                assert_eq!(option_id, "allow_always");
                assert_eq!(behavior, Behavior::Allow);
                assert_eq!(message.as_deref(), Some("go ahead"));
                assert_eq!(updated_input, None);
            }
            other => panic!("the provider heard {other:?}"),
        }
    }

    #[test]
    fn a_duplicate_answer_finds_the_request_no_longer_pending() {
        let mut set = Permissions::default();
        let (id, _rx) = request(&mut set);
        let a = answer(Behavior::Deny, None);
        let option = set.choose(id, &a).unwrap().unwrap();
        assert_eq!(option.id, "reject_once", "the first option of the behavior");
        set.answer(id).unwrap().selected(option, a.clone());
        assert!(set.choose(id, &a).is_none());
        assert!(set.answer(id).is_none());
        // The stored row says it was resolved: the second answer is told so.
        assert!(matches!(
            state_error(Some("resolved")),
            RuntimeError::PermissionAlreadyResolved
        ));
    }

    #[test]
    fn the_end_of_a_turn_expires_every_pending_request_and_cancels_it_for_the_provider() {
        let mut set = Permissions::default();
        let (first, mut rx1) = request(&mut set);
        let (second, mut rx2) = request(&mut set);
        let mut expired = set.expire_all();
        expired.sort();
        let mut both = vec![first, second];
        both.sort();
        assert_eq!(expired, both);
        assert!(set.is_empty());
        assert!(matches!(rx1.try_recv(), Ok(PermissionDecision::Cancelled)));
        assert!(matches!(rx2.try_recv(), Ok(PermissionDecision::Cancelled)));
        assert!(set.expire_all().is_empty(), "nothing expires twice");
        assert_eq!(
            expired_resolution(),
            json!({"behavior": "deny", "expired": true})
        );
    }

    #[test]
    fn an_answer_after_the_turn_ended_is_refused_as_expired() {
        let mut set = Permissions::default();
        let (id, _rx) = request(&mut set);
        set.expire_all();
        assert!(set.choose(id, &answer(Behavior::Allow, None)).is_none());
        assert!(set.answer(id).is_none());
        assert!(matches!(
            state_error(Some("expired")),
            RuntimeError::PermissionExpired(_)
        ));
        assert!(matches!(
            state_error(Some("pending")),
            RuntimeError::PermissionExpired(_)
        ));
        assert!(matches!(
            state_error(None),
            RuntimeError::PermissionNotFound
        ));
    }

    #[test]
    fn an_invalid_answer_leaves_the_request_pending() {
        let mut set = Permissions::default();
        let (id, mut rx) = request(&mut set);
        let unknown = set
            .choose(id, &answer(Behavior::Allow, Some("nope")))
            .unwrap();
        assert!(matches!(unknown, Err(RuntimeError::UnknownOption(o)) if o == "nope"));
        let mismatch = set
            .choose(id, &answer(Behavior::Deny, Some("allow_once")))
            .unwrap();
        assert!(matches!(
            mismatch,
            Err(RuntimeError::BehaviorMismatch { option, actual: "allow", requested: "deny" })
                if option == "allow_once"
        ));
        assert!(!set.is_empty());
        assert!(matches!(rx.try_recv(), Err(TryRecvError::Empty)));
        // A valid answer still goes through.
        assert!(
            set.choose(id, &answer(Behavior::Allow, None))
                .unwrap()
                .is_ok()
        );
    }

    #[test]
    fn a_behavior_no_option_offers_is_refused() {
        let only_allow = [option("yes", Behavior::Allow)];
        assert!(matches!(
            pick_option(&only_allow, Behavior::Deny, None),
            Err(RuntimeError::NoOptionForBehavior("deny"))
        ));
    }

    #[test]
    fn a_withdrawn_or_abandoned_request_ends_without_a_decision() {
        let mut set = Permissions::default();
        let (withdrawn, mut rx1) = request(&mut set);
        let (other, mut rx2) = request(&mut set);
        set.forget(withdrawn);
        assert!(matches!(rx1.try_recv(), Err(TryRecvError::Closed)));
        assert!(
            set.choose(withdrawn, &answer(Behavior::Allow, None))
                .is_none()
        );
        assert!(!set.is_empty(), "the other request is still pending");
        set.abandon();
        assert!(set.is_empty());
        assert!(matches!(rx2.try_recv(), Err(TryRecvError::Closed)));
        assert!(set.answer(other).is_none());
    }

    #[test]
    fn an_answer_the_provider_no_longer_waits_for_is_harmless() {
        let mut set = Permissions::default();
        let (id, rx) = request(&mut set);
        drop(rx);
        let a = answer(Behavior::Allow, Some("allow_once"));
        let option = set.choose(id, &a).unwrap().unwrap();
        set.answer(id).unwrap().selected(option, a);
        assert!(set.is_empty());
    }
}
