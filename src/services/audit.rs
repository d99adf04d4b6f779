//! The audit log: every action that changes a team's work or its access is recorded with
//! who did it (a person, a service token or the server admin), the team, the target, a
//! few details (never a secret or a token value) and the request id. Where the action is
//! one database write the entry is written in the same transaction (`record_in`);
//! otherwise right after the action succeeded (`record`, in batches: `AuditLog`), and a
//! failure to record is logged and answered as an error, never swallowed.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use sqlx::PgExecutor;
use tokio::sync::{mpsc, oneshot};
use utoipa::ToSchema;
use uuid::Uuid;

use super::{Data, ServiceError, ServiceResult};
use crate::auth::{ActorKind, AuthError, Operation, Principal, Role};
use crate::domain::{AuditId, TeamId, TokenId, UserId};
use crate::events::{Fault, classify, is_unavailable};
use crate::store;

/// What was done. The wire name is dotted (`agent.create`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    AgentCreate,
    AgentPrompt,
    AgentInterrupt,
    AgentArchive,
    PermissionAnswer,
    WorkspaceCreate,
    WorkspaceArchive,
    ProjectCreate,
    ProjectDelete,
    TeamCreate,
    MemberAdd,
    MemberRemove,
    MemberRole,
    TokenCreate,
    TokenRevoke,
    UserCreate,
    SecretSet,
    SecretDelete,
    AuthSignIn,
    HookCreate,
    HookUpdate,
    HookDelete,
    HookFail,
    NetworkSet,
    TeamSandbox,
    TeamAgentryMcp,
    BudgetSet,
    WorkspacePush,
    WorkspacePullRequest,
    TriggerCreate,
    TriggerUpdate,
    TriggerDelete,
    TriggerRun,
}

impl Action {
    pub const ALL: [Action; 33] = [
        Action::AgentCreate,
        Action::AgentPrompt,
        Action::AgentInterrupt,
        Action::AgentArchive,
        Action::PermissionAnswer,
        Action::WorkspaceCreate,
        Action::WorkspaceArchive,
        Action::ProjectCreate,
        Action::ProjectDelete,
        Action::TeamCreate,
        Action::MemberAdd,
        Action::MemberRemove,
        Action::MemberRole,
        Action::TokenCreate,
        Action::TokenRevoke,
        Action::UserCreate,
        Action::SecretSet,
        Action::SecretDelete,
        Action::AuthSignIn,
        Action::HookCreate,
        Action::HookUpdate,
        Action::HookDelete,
        Action::HookFail,
        Action::NetworkSet,
        Action::TeamSandbox,
        Action::TeamAgentryMcp,
        Action::BudgetSet,
        Action::WorkspacePush,
        Action::WorkspacePullRequest,
        Action::TriggerCreate,
        Action::TriggerUpdate,
        Action::TriggerDelete,
        Action::TriggerRun,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Action::AgentCreate => "agent.create",
            Action::AgentPrompt => "agent.prompt",
            Action::AgentInterrupt => "agent.interrupt",
            Action::AgentArchive => "agent.archive",
            Action::PermissionAnswer => "permission.answer",
            Action::WorkspaceCreate => "workspace.create",
            Action::WorkspaceArchive => "workspace.archive",
            Action::ProjectCreate => "project.create",
            Action::ProjectDelete => "project.delete",
            Action::TeamCreate => "team.create",
            Action::MemberAdd => "member.add",
            Action::MemberRemove => "member.remove",
            Action::MemberRole => "member.role",
            Action::TokenCreate => "token.create",
            Action::TokenRevoke => "token.revoke",
            Action::UserCreate => "user.create",
            Action::SecretSet => "secret.set",
            Action::SecretDelete => "secret.delete",
            Action::AuthSignIn => "auth.sign_in",
            Action::HookCreate => "hook.create",
            Action::HookUpdate => "hook.update",
            Action::HookDelete => "hook.delete",
            Action::HookFail => "hook.fail",
            Action::NetworkSet => "network.set",
            Action::TeamSandbox => "team.sandbox",
            Action::TeamAgentryMcp => "team.agentry_mcp",
            Action::BudgetSet => "budget.set",
            Action::WorkspacePush => "workspace.push",
            Action::WorkspacePullRequest => "workspace.pull_request",
            Action::TriggerCreate => "trigger.create",
            Action::TriggerUpdate => "trigger.update",
            Action::TriggerDelete => "trigger.delete",
            Action::TriggerRun => "trigger.run",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Action::ALL.into_iter().find(|a| a.as_str() == s)
    }
}

/// One thing to record: the action, the team it happened in (none for server-wide
/// actions such as a personal token), its target and details.
#[derive(Debug, Clone)]
pub struct Entry {
    pub action: Action,
    pub team_id: Option<Uuid>,
    /// The target's kind (`agent`, `workspace`, `member`, …) and its API id.
    pub target: (&'static str, String),
    /// A small JSON object; never a secret or a token value.
    pub details: Value,
}

impl Entry {
    pub fn new(
        action: Action,
        team_id: Option<Uuid>,
        kind: &'static str,
        id: impl ToString,
    ) -> Self {
        Self {
            action,
            team_id,
            target: (kind, id.to_string()),
            details: json!({}),
        }
    }

    pub fn details(mut self, details: Value) -> Self {
        self.details = details;
        self
    }
}

/// Who acted, as a principal or (for a sign-in) as a user about to get one.
pub struct Actor<'a> {
    pub kind: ActorKind,
    pub id: Uuid,
    pub request_id: Option<&'a str>,
    /// For an agent acting through its token: the person behind it (its creator), named
    /// in the entry's details as `on_behalf_of`.
    pub on_behalf_of: Option<Uuid>,
}

impl<'a> From<&'a Principal> for Actor<'a> {
    fn from(p: &'a Principal) -> Self {
        let (kind, id) = p.actor();
        Actor {
            kind,
            id,
            request_id: p.request_id.as_deref(),
            on_behalf_of: p.agent.map(|_| p.user_id),
        }
    }
}

/// Record `entry` in the transaction (or on the connection) of the action itself.
#[tracing::instrument(name = "services::audit::record_in", skip_all)]
pub async fn record_in<'a>(
    db: impl PgExecutor<'_>,
    actor: impl Into<Actor<'a>>,
    entry: &Entry,
) -> Result<(), sqlx::Error> {
    let row = OwnedEntry::new(&actor.into(), entry);
    store::audit::insert(db, &[row.row()]).await
}

/// Entries recorded after their action (`record`), written in batches: those that arrive
/// while a batch is being written go together in the next statement and commit, so a
/// burst of actions (a thousand prompts at once) costs a few commits, not one each. Every
/// caller still waits for its own entry. A batch the database refuses for its content is
/// written again entry by entry, so each caller hears of its own entry's fate; when the
/// store cannot be reached, every caller of the batch hears that at once.
#[derive(Clone)]
pub struct AuditLog {
    tx: mpsc::UnboundedSender<Queued>,
}

struct Queued {
    entry: OwnedEntry,
    done: oneshot::Sender<ServiceResult<()>>,
}

/// An entry as it is written, owning what it says.
struct OwnedEntry {
    id: Uuid,
    actor_kind: &'static str,
    actor_id: Uuid,
    team_id: Option<Uuid>,
    action: &'static str,
    target_kind: &'static str,
    target_id: String,
    details: Value,
    request_id: Option<String>,
}

impl OwnedEntry {
    /// `entry` by `actor`, under a new id.
    fn new(actor: &Actor<'_>, entry: &Entry) -> Self {
        let mut details = entry.details.clone();
        if let Some(person) = actor.on_behalf_of {
            match &mut details {
                Value::Object(m) => {
                    m.insert("on_behalf_of".into(), json!(UserId::from(person)));
                }
                other => {
                    *other = json!({"on_behalf_of": UserId::from(person)});
                }
            }
        }
        Self {
            id: AuditId::new().uuid(),
            actor_kind: actor.kind.as_str(),
            actor_id: actor.id,
            team_id: entry.team_id,
            action: entry.action.as_str(),
            target_kind: entry.target.0,
            target_id: entry.target.1.clone(),
            details,
            request_id: actor.request_id.map(str::to_owned),
        }
    }

    fn row(&self) -> store::audit::NewEntry<'_> {
        store::audit::NewEntry {
            id: self.id,
            actor_kind: self.actor_kind,
            actor_id: self.actor_id,
            team_id: self.team_id,
            action: self.action,
            target_kind: self.target_kind,
            target_id: &self.target_id,
            details: &self.details,
            request_id: self.request_id.as_deref(),
        }
    }
}

impl AuditLog {
    /// Most entries in one statement.
    const MAX_BATCH: usize = 512;

    /// Start the batching task on the current runtime. Its statements have `pool`'s
    /// deadline.
    pub fn spawn(pool: store::DeadlinePool) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(Self::run(pool, rx));
        Self { tx }
    }

    async fn run(pool: store::DeadlinePool, mut rx: mpsc::UnboundedReceiver<Queued>) {
        let mut batch = Vec::with_capacity(Self::MAX_BATCH);
        while rx.recv_many(&mut batch, Self::MAX_BATCH).await > 0 {
            let rows: Vec<_> = batch.iter().map(|q| q.entry.row()).collect();
            let written = store::audit::insert(&pool, &rows).await;
            drop(rows);
            match written {
                Ok(()) => {
                    for q in batch.drain(..) {
                        let _ = q.done.send(Ok(()));
                    }
                }
                Err(e) if batch.len() == 1 => {
                    if let Some(q) = batch.pop() {
                        let _ = q.done.send(Err(e.into()));
                    }
                }
                Err(e) if classify(&e) == Fault::Content => {
                    for q in batch.drain(..) {
                        let r = store::audit::insert(&pool, &[q.entry.row()]).await;
                        let _ = q.done.send(r.map_err(ServiceError::from));
                    }
                }
                Err(e) => {
                    // Not the entries: the same answer for each of them, at once.
                    tracing::warn!(error = %e, entries = batch.len(), "could not write a batch of audit entries");
                    for q in batch.drain(..) {
                        let _ = q.done.send(Err(if is_unavailable(&e) {
                            ServiceError::StoreUnavailable
                        } else {
                            ServiceError::Unexpected(anyhow::anyhow!("{e}"))
                        }));
                    }
                }
            }
        }
    }

    /// Queue `entry` and wait until it is committed, at most the store's deadline.
    async fn write(
        &self,
        actor: &Actor<'_>,
        entry: &Entry,
        deadline: Duration,
    ) -> Result<(), ServiceError> {
        let (done, rx) = oneshot::channel();
        let queued = Queued {
            entry: OwnedEntry::new(actor, entry),
            done,
        };
        self.tx
            .send(queued)
            .map_err(|_| ServiceError::StoreUnavailable)?;
        match tokio::time::timeout(deadline, rx).await {
            Ok(Ok(written)) => written,
            Ok(Err(_)) | Err(_) => Err(ServiceError::StoreUnavailable),
        }
    }
}

/// Record `entry` after its action succeeded. A failure is logged with what was not
/// recorded, and returned: an action that cannot be audited is not reported as done.
#[tracing::instrument(name = "services::audit::record", skip_all)]
pub async fn record<'a>(
    data: &Data,
    actor: impl Into<Actor<'a>>,
    entry: Entry,
) -> ServiceResult<()> {
    let actor = actor.into();
    if let Err(e) = data.audit.write(&actor, &entry, data.pool.deadline()).await {
        let request_id = actor.request_id.unwrap_or("");
        tracing::error!(
            error = %e,
            action = entry.action.as_str(),
            target_kind = entry.target.0,
            target_id = %entry.target.1,
            request_id,
            "the action succeeded but could not be recorded in the audit log"
        );
        return Err(e);
    }
    Ok(())
}

/// Record that `user` signed in (`auth.sign_in`), whichever way they did: one call for
/// every sign-in path. `details` says how (e.g. `{"method": "oidc"}`); never a token.
#[tracing::instrument(name = "services::audit::record_sign_in", skip_all, fields(user_id = %user))]
pub async fn record_sign_in(
    data: &Data,
    user: Uuid,
    request_id: Option<&str>,
    details: Value,
) -> ServiceResult<()> {
    record(
        data,
        Actor {
            kind: ActorKind::User,
            id: user,
            request_id,
            on_behalf_of: None,
        },
        Entry::new(Action::AuthSignIn, None, "user", UserId::from(user)).details(details),
    )
    .await
}

/// Who did it.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditActor {
    /// `user`, `service_token`, `admin` or `agent` (an agent through its own token; the
    /// entry's `details.on_behalf_of` names the person behind it).
    pub kind: String,
    /// A `usr_…` id, or a `tok_…` id for a service token.
    pub id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub email: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AuditTarget {
    pub kind: String,
    pub id: String,
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"id": "aud_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "at": "2026-11-30T12:00:00Z",
    "actor": {"kind": "user", "id": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "email": "ana@example.com"},
    "team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6d", "action": "permission.answer",
    "target": {"kind": "permission", "id": "perm_0193a1b2c3d47e8f9a0b1c2d3e4f5a6e"},
    "details": {"agent_id": "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6f", "behavior": "allow"},
    "request_id": "0193a1b2c3d47e8f9a0b1c2d3e4f5a70"}))]
pub struct AuditEntry {
    pub id: AuditId,
    pub at: DateTime<Utc>,
    pub actor: AuditActor,
    pub team_id: Option<TeamId>,
    pub action: String,
    pub target: AuditTarget,
    #[schema(value_type = Object)]
    pub details: Value,
    pub request_id: Option<String>,
}

impl From<store::audit::EntryRow> for AuditEntry {
    fn from(r: store::audit::EntryRow) -> Self {
        let actor_id = r.actor_id.map(|id| {
            if r.actor_kind == ActorKind::ServiceToken.as_str() {
                TokenId::from(id).to_string()
            } else if r.actor_kind == ActorKind::Agent.as_str() {
                crate::domain::AgentId::from(id).to_string()
            } else {
                UserId::from(id).to_string()
            }
        });
        Self {
            id: r.id.into(),
            at: r.at,
            actor: AuditActor {
                kind: r.actor_kind,
                id: actor_id,
                email: r.actor_email,
            },
            team_id: r.team_id.map(Into::into),
            action: r.action,
            target: AuditTarget {
                kind: r.target_kind,
                id: r.target_id,
            },
            details: r.details,
            request_id: r.request_id,
        }
    }
}

/// Which entries `list` returns; `actor_id` is a person's or a service token's id.
#[derive(Debug, Default)]
pub struct AuditFilter {
    pub team_id: Option<TeamId>,
    pub action: Option<String>,
    pub actor_id: Option<Uuid>,
}

/// A page of the audit log, newest first: owners read their teams' entries, admins all.
#[tracing::instrument(name = "services::audit::list", skip_all)]
pub async fn list(
    data: &Data,
    principal: &Principal,
    filter: &AuditFilter,
    before: Option<AuditId>,
    limit: i64,
) -> ServiceResult<Vec<AuditEntry>> {
    principal.authorize(Operation::ReadAsOwner)?;
    if let Some(a) = &filter.action
        && Action::parse(a).is_none()
    {
        return Err(ServiceError::invalid(
            "action",
            format!("unknown action `{a}`"),
        ));
    }
    let teams: Option<Vec<Uuid>> = match filter.team_id {
        Some(team) => {
            principal.authorize_in(team.uuid(), Operation::ReadAsOwner, "team")?;
            if store::teams::get(&data.pool, team.uuid()).await?.is_none() {
                return Err(ServiceError::NotFound("team"));
            }
            Some(vec![team.uuid()])
        }
        None if principal.is_server_admin() => None,
        None => {
            let owned: Vec<Uuid> = principal
                .teams
                .iter()
                .filter(|m| principal.role_in(m.team_id) == Some(Role::Owner))
                .map(|m| m.team_id)
                .collect();
            if owned.is_empty() {
                return Err(AuthError::Forbidden(
                    "the audit log is for team owners and server admins",
                )
                .into());
            }
            Some(owned)
        }
    };
    let rows = store::audit::list(
        &data.pool,
        store::audit::Filter {
            teams: teams.as_deref(),
            action: filter.action.as_deref(),
            actor_id: filter.actor_id,
            before: before.map(|b| b.uuid()),
            limit,
        },
    )
    .await?;
    Ok(rows.into_iter().map(AuditEntry::from).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_names_round_trip() {
        for a in Action::ALL {
            assert_eq!(Action::parse(a.as_str()), Some(a));
        }
        assert_eq!(Action::parse("agent.delete"), None);
    }

    /// The dashboard's audit filter offers every action the server records.
    #[test]
    fn the_dashboard_filters_by_every_action() {
        let ui = include_str!("../../ui/app.js");
        let list = &ui[ui.find("const AUDIT_ACTIONS = [").expect("the list")..];
        let list = &list[..list.find("];").expect("its end")];
        for a in Action::ALL {
            assert!(
                list.contains(&format!("\"{}\"", a.as_str())),
                "ui/app.js AUDIT_ACTIONS lacks {}",
                a.as_str()
            );
        }
    }
}
