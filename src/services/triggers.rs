//! Triggers: what starts or continues agents without a person at the keyboard. A
//! `github` or `gitlab` trigger receives its forge's webhook deliveries (verified with
//! the trigger's secret, deduplicated by delivery id) and maps them by its rules: an
//! issue labelled opens an agent, a comment mentioning the handle on a pull request an
//! agent opened is sent to that agent, a failed check on such a pull request tells the
//! agent what failed. A `cron` trigger opens an agent at every slot of its schedule; the
//! replicas' schedulers claim each slot in the database, so it runs once.
//!
//! A trigger acts as the person who created it, through the same services as the API
//! (their role in the team now, the team's budget, hooks and sandbox requirement); the
//! audit log names them, with the trigger and run as the request id.

mod cron;
mod payload;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use utoipa::ToSchema;
use uuid::Uuid;

use super::audit::{self, Action, Entry};
use super::{ServiceContext, ServiceError, ServiceResult};
use crate::auth::{Membership, Operation, Principal, Role};
use crate::config::TriggerSettings;
use crate::domain::{
    AgentId, ProjectId, SecretValue, TeamId, TriggerId, TriggerRunId, UserId, WorkspaceId,
};
use crate::forge::ForgeKind;
use crate::store;
use crate::store::triggers::{RunRow, TriggerRow};

pub use cron::Schedule;
use payload::{Decision, Target};

/// Longest prompt template or schedule prompt, in bytes.
const MAX_PROMPT: usize = 64 * 1024;

// ---- The running machinery -------------------------------------------------------

/// The triggers' settings and the scheduler's clock.
pub struct Triggers {
    pub settings: TriggerSettings,
    /// `Some` when `triggers.manual_clock_start` is set (tests): the time, moved by hand.
    manual: Option<watch::Sender<DateTime<Utc>>>,
    /// The latest time the scheduler finished looking at.
    handled: watch::Sender<Option<DateTime<Utc>>>,
    /// Wakes this replica's worker: a run is pending.
    wake: tokio::sync::Notify,
}

impl std::fmt::Debug for Triggers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Triggers").finish_non_exhaustive()
    }
}

impl Triggers {
    pub fn new(settings: &TriggerSettings) -> Self {
        Self {
            settings: settings.clone(),
            manual: settings.manual_clock_start.map(|t| watch::channel(t).0),
            handled: watch::channel(None).0,
            wake: tokio::sync::Notify::new(),
        }
    }

    /// The scheduler's time.
    pub fn now(&self) -> DateTime<Utc> {
        match &self.manual {
            Some(m) => *m.borrow(),
            None => Utc::now(),
        }
    }

    /// Moves a manual clock (tests) to `at`; the scheduler looks at once.
    pub fn set_clock(&self, at: DateTime<Utc>) {
        let m = self
            .manual
            .as_ref()
            .expect("the clock is manual only with triggers.manual_clock_start");
        m.send_replace(at);
    }

    /// Resolves once the scheduler has handled every slot up to `at` (tests).
    pub async fn handled_through(&self, at: DateTime<Utc>) {
        let mut rx = self.handled.subscribe();
        let _ = rx.wait_for(|h| h.is_some_and(|h| h >= at)).await;
    }
}

// ---- API types ----------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TriggerKind {
    /// GitHub webhook deliveries, signed with `X-Hub-Signature-256`.
    Github,
    /// GitLab webhook deliveries, carrying `X-Gitlab-Token`.
    Gitlab,
    /// A schedule.
    Cron,
}

impl TriggerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Github => "github",
            Self::Gitlab => "gitlab",
            Self::Cron => "cron",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "github" => Some(Self::Github),
            "gitlab" => Some(Self::Gitlab),
            "cron" => Some(Self::Cron),
            _ => None,
        }
    }

    fn forge(self) -> Option<ForgeKind> {
        match self {
            Self::Github => Some(ForgeKind::GitHub),
            Self::Gitlab => Some(ForgeKind::GitLab),
            Self::Cron => None,
        }
    }
}

/// What a cron trigger does with a slot that came while every replica was down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Missed {
    /// Run once at the next start, however many slots were missed (default).
    #[default]
    RunOnce,
    /// Record the missed slot as `ignored` and wait for the next one.
    Skip,
}

fn default_label() -> String {
    "agentry".into()
}

fn default_template() -> String {
    "{{title}}\n\n{{body}}\n\n(issue #{{number}}: {{url}})".into()
}

fn default_handle() -> String {
    "@agentry".into()
}

fn default_excerpt() -> usize {
    8 * 1024
}

/// Open an agent when an issue gets a label.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IssueRule {
    /// Default `agentry`.
    #[serde(default = "default_label")]
    pub label: String,
    /// The agent's first prompt: `{{title}}`, `{{body}}`, `{{number}}` and `{{url}}`
    /// are replaced by the issue's (plain substitution, never evaluated).
    #[serde(default = "default_template")]
    pub prompt: String,
}

/// Send a comment that mentions the handle on a pull/merge request an agent of the
/// team opened to that agent (queued while it is busy).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MentionRule {
    /// Default `@agentry`.
    #[serde(default = "default_handle")]
    pub handle: String,
}

/// Tell the agent of a pull/merge request which check failed, with an excerpt of its
/// output or log.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FailedCheckRule {
    /// The excerpt's size at most, in bytes (its end is kept; default 8192, at most 65536).
    #[serde(default = "default_excerpt")]
    pub max_excerpt_bytes: usize,
}

fn some_issue_rule() -> Option<IssueRule> {
    Some(IssueRule {
        label: default_label(),
        prompt: default_template(),
    })
}

fn some_mention_rule() -> Option<MentionRule> {
    Some(MentionRule {
        handle: default_handle(),
    })
}

fn some_failed_check_rule() -> Option<FailedCheckRule> {
    Some(FailedCheckRule {
        max_excerpt_bytes: default_excerpt(),
    })
}

/// A webhook trigger's rules: each is on with its defaults unless given as `null`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"issue_labeled": {"label": "agentry", "prompt": "Fix: {{title}}\n\n{{body}}"},
    "mention": {"handle": "@agentry"}, "failed_check": {"max_excerpt_bytes": 8192}}))]
pub struct Rules {
    #[serde(default = "some_issue_rule")]
    pub issue_labeled: Option<IssueRule>,
    #[serde(default = "some_mention_rule")]
    pub mention: Option<MentionRule>,
    #[serde(default = "some_failed_check_rule")]
    pub failed_check: Option<FailedCheckRule>,
}

impl Default for Rules {
    fn default() -> Self {
        Self {
            issue_labeled: some_issue_rule(),
            mention: some_mention_rule(),
            failed_check: some_failed_check_rule(),
        }
    }
}

/// What a trigger does, as stored (`triggers.spec`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Spec {
    provider: String,
    model: Option<String>,
    mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rules: Option<Rules>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    schedule: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    time_zone: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    missed: Option<Missed>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prompt: Option<String>,
}

/// The body of `POST /v1/triggers`.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "issues of web", "kind": "github",
    "project_id": "prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "provider": "claude",
    "rules": {"issue_labeled": {"label": "agentry"}, "mention": {"handle": "@agentry"}}}))]
pub struct CreateTrigger {
    pub name: String,
    pub kind: TriggerKind,
    /// The project agents are opened in (and whose pull requests' agents are found).
    pub project_id: ProjectId,
    /// The provider, model and mode of the agents the trigger opens.
    pub provider: String,
    pub model: Option<String>,
    pub mode: Option<String>,
    pub enabled: Option<bool>,
    /// `github` and `gitlab` only (default: every rule on, with its defaults).
    pub rules: Option<Rules>,
    /// `cron` only: five fields (minute hour day-of-month month day-of-week).
    pub schedule: Option<String>,
    /// `cron` only: the IANA time zone the schedule is read in (default `UTC`).
    pub time_zone: Option<String>,
    /// `cron` only: `run_once` (default) or `skip`.
    pub missed: Option<Missed>,
    /// `cron` only: the prompt of the agent each slot opens.
    pub prompt: Option<String>,
}

/// The body of `PATCH /v1/triggers/{id}`: what is given changes (the kind, project and
/// secret do not).
#[derive(Debug, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"enabled": false}))]
pub struct PatchTrigger {
    pub name: Option<String>,
    pub enabled: Option<bool>,
    pub provider: Option<String>,
    pub model: Option<String>,
    pub mode: Option<String>,
    pub rules: Option<Rules>,
    pub schedule: Option<String>,
    pub time_zone: Option<String>,
    pub missed: Option<Missed>,
    pub prompt: Option<String>,
}

/// A trigger as clients see it. Its secret is shown once, in the answer that created it.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"id": "trg_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c",
    "project_id": "prj_0193a1b2c3d47e8f9a0b1c2d3e4f5a6d", "name": "issues of web", "kind": "github",
    "enabled": true, "provider": "claude", "model": null, "mode": null,
    "rules": {"issue_labeled": {"label": "agentry", "prompt": "{{title}}\n\n{{body}}"},
        "mention": {"handle": "@agentry"}, "failed_check": {"max_excerpt_bytes": 8192}},
    "schedule": null, "time_zone": null, "missed": null, "prompt": null,
    "webhook_path": "/hooks/triggers/trg_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "next_run_at": null,
    "created_by": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6e", "created_at": "2026-12-06T12:00:00Z",
    "secret": "4f1c…"}))]
pub struct Trigger {
    pub id: TriggerId,
    pub team_id: TeamId,
    pub project_id: ProjectId,
    pub name: String,
    pub kind: TriggerKind,
    pub enabled: bool,
    pub provider: String,
    pub model: Option<String>,
    pub mode: Option<String>,
    pub rules: Option<Rules>,
    pub schedule: Option<String>,
    pub time_zone: Option<String>,
    pub missed: Option<Missed>,
    pub prompt: Option<String>,
    /// Webhooks: where the forge delivers, on this server (`POST`, no bearer token).
    pub webhook_path: Option<String>,
    /// Cron: the next slot.
    pub next_run_at: Option<DateTime<Utc>>,
    /// Whom the trigger acts as.
    pub created_by: UserId,
    pub created_at: DateTime<Utc>,
    /// Webhooks, only in the answer to `POST /v1/triggers`: the secret to configure on
    /// the forge (GitHub: the webhook's secret; GitLab: its secret token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

/// One delivery or schedule slot and what the trigger did with it.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"id": "trun_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b",
    "trigger_id": "trg_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "delivery_id": "72d3162e-cc78-11e3-81ab-4c9367dc0958",
    "slot": null, "event": "issues", "state": "done", "outcome": "started_agent", "reason": null,
    "agent_id": "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6d", "workspace_id": "wsp_0193a1b2c3d47e8f9a0b1c2d3e4f5a6e",
    "created_at": "2026-12-06T12:00:00Z"}))]
pub struct TriggerRun {
    pub id: TriggerRunId,
    pub trigger_id: TriggerId,
    /// A webhook delivery's id (`X-GitHub-Delivery`, `X-Gitlab-Event-UUID`,
    /// `Idempotency-Key`, else `sha256:` of the body).
    pub delivery_id: Option<String>,
    /// A cron run's slot.
    pub slot: Option<DateTime<Utc>>,
    /// The forge's event name, or `schedule`.
    pub event: String,
    /// `pending` (received; a worker acts on it soon), `running`, `done` or `failed`.
    pub state: String,
    /// `started_agent`, `sent_message`, `queued`, `ignored` or `failed`; `null` while
    /// the run is pending or running.
    pub outcome: Option<String>,
    /// Why it was ignored or failed, or a note on what was done.
    pub reason: Option<String>,
    pub agent_id: Option<AgentId>,
    pub workspace_id: Option<WorkspaceId>,
    pub created_at: DateTime<Utc>,
}

impl From<RunRow> for TriggerRun {
    fn from(r: RunRow) -> Self {
        Self {
            id: r.id.into(),
            trigger_id: r.trigger_id.into(),
            delivery_id: r.delivery_id,
            slot: r.slot,
            event: r.event,
            state: r.state,
            outcome: r.outcome,
            reason: r.reason,
            agent_id: r.agent_id.map(Into::into),
            workspace_id: r.workspace_id.map(Into::into),
            created_at: r.created_at,
        }
    }
}

/// The answer to a webhook delivery.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Receipt {
    /// The delivery was received before: nothing was done again; `run` is the first.
    pub duplicate: bool,
    pub run: TriggerRun,
}

fn spec_of(row: &TriggerRow) -> ServiceResult<Spec> {
    serde_json::from_value(row.spec.clone())
        .map_err(|e| ServiceError::Unexpected(anyhow::anyhow!("stored trigger spec: {e}")))
}

fn view(ctx: &ServiceContext, row: &TriggerRow, secret: Option<String>) -> ServiceResult<Trigger> {
    let spec = spec_of(row)?;
    let kind = TriggerKind::parse(&row.kind).unwrap_or(TriggerKind::Cron);
    let next_run_at = match (&spec.schedule, row.enabled) {
        (Some(s), true) => {
            let tz = cron::time_zone(spec.time_zone.as_deref().unwrap_or("UTC")).ok();
            let sched = Schedule::parse(s).ok();
            tz.zip(sched)
                .and_then(|(tz, s)| s.next_after(&tz, ctx.triggers.now()))
        }
        _ => None,
    };
    Ok(Trigger {
        id: row.id.into(),
        team_id: row.team_id.into(),
        project_id: row.project_id.into(),
        name: row.name.clone(),
        kind,
        enabled: row.enabled,
        provider: spec.provider,
        model: spec.model,
        mode: spec.mode,
        rules: spec.rules,
        schedule: spec.schedule,
        time_zone: spec.time_zone,
        missed: spec.missed,
        prompt: spec.prompt,
        webhook_path: (kind != TriggerKind::Cron)
            .then(|| format!("/hooks/triggers/{}", TriggerId::from(row.id))),
        next_run_at,
        created_by: row.created_by.into(),
        created_at: row.created_at,
        secret,
    })
}

// ---- Validation ---------------------------------------------------------------------

fn check_name(name: &str) -> ServiceResult<()> {
    if name.trim().is_empty() || name.len() > 200 || name.chars().any(char::is_control) {
        return Err(ServiceError::invalid(
            "name",
            "must be 1 to 200 characters, without control characters",
        ));
    }
    Ok(())
}

fn check_text(field: &'static str, text: &str) -> ServiceResult<()> {
    if text.trim().is_empty() || text.len() > MAX_PROMPT {
        return Err(ServiceError::invalid(
            field,
            format!("must be 1 to {MAX_PROMPT} bytes"),
        ));
    }
    Ok(())
}

/// Checks a spec against its kind: each kind takes only its own fields.
fn check_spec(ctx: &ServiceContext, kind: TriggerKind, spec: &mut Spec) -> ServiceResult<()> {
    if ctx.fleet.agents.registry().get(&spec.provider).is_none() {
        return Err(ServiceError::UnknownProvider(spec.provider.clone()));
    }
    for (field, v) in [("model", &spec.model), ("mode", &spec.mode)] {
        if let Some(v) = v
            && (v.trim().is_empty() || v.len() > 200)
        {
            return Err(ServiceError::invalid(field, "must be 1 to 200 characters"));
        }
    }
    match kind {
        TriggerKind::Github | TriggerKind::Gitlab => {
            for (field, set) in [
                ("schedule", spec.schedule.is_some()),
                ("time_zone", spec.time_zone.is_some()),
                ("missed", spec.missed.is_some()),
                ("prompt", spec.prompt.is_some()),
            ] {
                if set {
                    return Err(ServiceError::invalid(
                        field,
                        "only cron triggers have it (a webhook trigger's prompt is rules.issue_labeled.prompt)",
                    ));
                }
            }
            let rules = spec.rules.get_or_insert_with(Rules::default);
            if let Some(r) = &rules.issue_labeled {
                if r.label.trim().is_empty() || r.label.len() > 200 {
                    return Err(ServiceError::invalid(
                        "rules.issue_labeled.label",
                        "must be 1 to 200 characters",
                    ));
                }
                check_text("rules.issue_labeled.prompt", &r.prompt)?;
            }
            if let Some(r) = &rules.mention {
                let name = r.handle.strip_prefix('@').unwrap_or("");
                if name.is_empty()
                    || name.len() > 100
                    || !name
                        .chars()
                        .all(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
                {
                    return Err(ServiceError::invalid(
                        "rules.mention.handle",
                        "must be `@` and a name (letters, digits, `-`, `_`, `.`, `/`)",
                    ));
                }
            }
            if let Some(r) = &rules.failed_check
                && !(256..=65_536).contains(&r.max_excerpt_bytes)
            {
                return Err(ServiceError::invalid(
                    "rules.failed_check.max_excerpt_bytes",
                    "must be between 256 and 65536",
                ));
            }
        }
        TriggerKind::Cron => {
            if spec.rules.is_some() {
                return Err(ServiceError::invalid(
                    "rules",
                    "only github and gitlab triggers have rules",
                ));
            }
            let Some(schedule) = &spec.schedule else {
                return Err(ServiceError::invalid(
                    "schedule",
                    "required for a cron trigger",
                ));
            };
            Schedule::parse(schedule).map_err(|m| ServiceError::invalid("schedule", m))?;
            let tz = spec.time_zone.get_or_insert_with(|| "UTC".into());
            cron::time_zone(tz).map_err(|m| ServiceError::invalid("time_zone", m))?;
            spec.missed.get_or_insert(Missed::RunOnce);
            match &spec.prompt {
                Some(p) => check_text("prompt", p)?,
                None => {
                    return Err(ServiceError::invalid(
                        "prompt",
                        "required for a cron trigger",
                    ));
                }
            }
        }
    }
    Ok(())
}

// ---- Secrets ------------------------------------------------------------------------

fn seal_name(id: Uuid) -> String {
    format!("trigger:{}", TriggerId::from(id))
}

fn new_secret() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}

fn open_secret(ctx: &ServiceContext, row: &TriggerRow) -> Result<SecretValue, String> {
    let (Some(key_id), Some(nonce), Some(ciphertext)) = (
        &row.secret_key_id,
        &row.secret_nonce,
        &row.secret_ciphertext,
    ) else {
        return Err("the trigger has no secret".into());
    };
    let sealed = super::secrets::Sealed {
        key_id: key_id.clone(),
        nonce: nonce.clone(),
        ciphertext: ciphertext.clone(),
    };
    ctx.access
        .secrets
        .open(row.team_id, &seal_name(row.id), &sealed)
        .map_err(|e| format!("its secret cannot be decrypted: {e}"))
}

/// Equal bytes, compared in time that depends only on the lengths.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Whether the delivery proves it knows the secret.
fn verified(kind: ForgeKind, secret: &SecretValue, d: &Delivery<'_>) -> bool {
    match kind {
        ForgeKind::GitHub => {
            let Some(tag) = d
                .signature
                .and_then(|s| s.strip_prefix("sha256="))
                .and_then(|h| hex::decode(h).ok())
            else {
                return false;
            };
            let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.expose().as_bytes());
            ring::hmac::verify(&key, d.body, &tag).is_ok()
        }
        ForgeKind::GitLab => d
            .gitlab_token
            .is_some_and(|t| same_bytes(t.as_bytes(), secret.expose().as_bytes())),
    }
}

/// Re-encrypts the webhook secrets that are not under the current key (`agentry secrets
/// rotate`). Returns how many were re-encrypted, and the triggers whose secret cannot be
/// opened with any key the server has.
#[tracing::instrument(name = "services::triggers::rotate", skip_all)]
pub async fn rotate(
    pool: &sqlx::PgPool,
    keys: &super::secrets::Keyring,
) -> Result<(usize, Vec<(TriggerId, super::secrets::OpenError)>), sqlx::Error> {
    super::secrets::rotate_sealed(pool, keys, store::sealed::SealedIn::Triggers, seal_name).await
}

// ---- CRUD ---------------------------------------------------------------------------

pub async fn create(
    ctx: &ServiceContext,
    principal: &Principal,
    body: &CreateTrigger,
) -> ServiceResult<Trigger> {
    principal.authorize(Operation::ManageTeam)?;
    let project = super::projects::find(&ctx.data, principal, body.project_id).await?;
    principal.authorize_in(project.team_id, Operation::ManageTeam, "project")?;
    // A trigger acts as the person who created it, with their role: a team service
    // token or an agent's token acts with less than its person, so it may not.
    if principal.user_id.is_nil() || principal.service_team.is_some() || principal.agent.is_some() {
        return Err(ServiceError::invalid(
            "token",
            "a trigger acts as the person who creates it: create it with a person's own token",
        ));
    }
    check_name(&body.name)?;
    let mut spec = Spec {
        provider: body.provider.clone(),
        model: body.model.clone(),
        mode: body.mode.clone(),
        rules: body.rules.clone(),
        schedule: body.schedule.clone(),
        time_zone: body.time_zone.clone(),
        missed: body.missed,
        prompt: body.prompt.clone(),
    };
    check_spec(ctx, body.kind, &mut spec)?;
    let id = Uuid::now_v7();
    let secret = (body.kind != TriggerKind::Cron).then(new_secret);
    let sealed = secret.as_ref().map(|s| {
        ctx.access.secrets.seal(
            project.team_id,
            &seal_name(id),
            &SecretValue::new(s.clone()),
        )
    });
    let spec_json = serde_json::to_value(&spec).map_err(|e| ServiceError::Unexpected(e.into()))?;
    let row = store::triggers::insert(
        &ctx.data.pool,
        &store::triggers::NewTrigger {
            id,
            team_id: project.team_id,
            project_id: project.id,
            name: &body.name,
            kind: body.kind.as_str(),
            enabled: body.enabled.unwrap_or(true),
            spec: &spec_json,
            sealed: sealed.as_ref().map(|s| {
                (
                    s.key_id.as_str(),
                    s.nonce.as_slice(),
                    s.ciphertext.as_slice(),
                )
            }),
            // Slots before the trigger existed are not missed ones.
            last_slot: (body.kind == TriggerKind::Cron).then(|| ctx.triggers.now()),
            created_by: principal.user_id,
        },
    )
    .await?;
    audit::record(
        &ctx.data,
        principal,
        Entry::new(
            Action::TriggerCreate,
            Some(row.team_id),
            "trigger",
            TriggerId::from(id),
        )
        .details(json!({"name": row.name, "kind": row.kind,
                "project_id": ProjectId::from(row.project_id), "enabled": row.enabled})),
    )
    .await?;
    view(ctx, &row, secret)
}

/// The trigger, when the caller may do `op` in its team; another team's is missing.
async fn load(
    ctx: &ServiceContext,
    principal: &Principal,
    id: TriggerId,
    op: Operation,
) -> ServiceResult<TriggerRow> {
    principal.authorize(op)?;
    let teams = principal.visible_teams();
    let row = store::triggers::get(&ctx.data.pool, id.uuid(), teams.as_deref())
        .await?
        .ok_or(ServiceError::NotFound("trigger"))?;
    principal.authorize_in(row.team_id, op, "trigger")?;
    Ok(row)
}

pub async fn get(
    ctx: &ServiceContext,
    principal: &Principal,
    id: TriggerId,
) -> ServiceResult<Trigger> {
    let row = load(ctx, principal, id, Operation::ReadTeam).await?;
    view(ctx, &row, None)
}

pub async fn list(
    ctx: &ServiceContext,
    principal: &Principal,
    after: Option<TriggerId>,
    limit: i64,
) -> ServiceResult<Vec<Trigger>> {
    principal.authorize(Operation::ReadTeam)?;
    let teams = principal.visible_teams().map(|t| {
        t.into_iter()
            .filter(|t| principal.service_team.is_none_or(|s| s == *t))
            .collect::<Vec<_>>()
    });
    let rows = store::triggers::list(
        &ctx.data.pool,
        teams.as_deref(),
        after.map(|a| a.uuid()),
        limit,
    )
    .await?;
    rows.iter().map(|r| view(ctx, r, None)).collect()
}

pub async fn update(
    ctx: &ServiceContext,
    principal: &Principal,
    id: TriggerId,
    body: &PatchTrigger,
) -> ServiceResult<Trigger> {
    let row = load(ctx, principal, id, Operation::ManageTeam).await?;
    let kind = TriggerKind::parse(&row.kind).unwrap_or(TriggerKind::Cron);
    let mut spec = spec_of(&row)?;
    if let Some(n) = &body.name {
        check_name(n)?;
    }
    if let Some(p) = &body.provider {
        spec.provider = p.clone();
    }
    if body.model.is_some() {
        spec.model = body.model.clone();
    }
    if body.mode.is_some() {
        spec.mode = body.mode.clone();
    }
    if body.rules.is_some() {
        spec.rules = body.rules.clone();
    }
    let timing = body.schedule.is_some()
        || body.time_zone.is_some()
        || body.enabled == Some(true) && !row.enabled;
    if body.schedule.is_some() {
        spec.schedule = body.schedule.clone();
    }
    if body.time_zone.is_some() {
        spec.time_zone = body.time_zone.clone();
    }
    if body.missed.is_some() {
        spec.missed = body.missed;
    }
    if body.prompt.is_some() {
        spec.prompt = body.prompt.clone();
    }
    check_spec(ctx, kind, &mut spec)?;
    let spec_json = serde_json::to_value(&spec).map_err(|e| ServiceError::Unexpected(e.into()))?;
    let updated = store::triggers::update(
        &ctx.data.pool,
        row.id,
        &store::triggers::TriggerChange {
            name: body.name.as_deref().unwrap_or(&row.name),
            enabled: body.enabled.unwrap_or(row.enabled),
            spec: &spec_json,
            // A new schedule, or one enabled again, starts from now: what passed
            // meanwhile is not a missed slot.
            last_slot: (kind == TriggerKind::Cron && timing).then(|| ctx.triggers.now()),
        },
    )
    .await?
    .ok_or(ServiceError::NotFound("trigger"))?;
    let changed: Vec<&str> = [
        ("name", body.name.is_some()),
        ("enabled", body.enabled.is_some()),
        ("provider", body.provider.is_some()),
        ("model", body.model.is_some()),
        ("mode", body.mode.is_some()),
        ("rules", body.rules.is_some()),
        ("schedule", body.schedule.is_some()),
        ("time_zone", body.time_zone.is_some()),
        ("missed", body.missed.is_some()),
        ("prompt", body.prompt.is_some()),
    ]
    .into_iter()
    .filter_map(|(f, set)| set.then_some(f))
    .collect();
    audit::record(
        &ctx.data,
        principal,
        Entry::new(Action::TriggerUpdate, Some(row.team_id), "trigger", id)
            .details(json!({"changed": changed, "enabled": updated.enabled})),
    )
    .await?;
    view(ctx, &updated, None)
}

pub async fn delete(
    ctx: &ServiceContext,
    principal: &Principal,
    id: TriggerId,
) -> ServiceResult<()> {
    let row = load(ctx, principal, id, Operation::ManageTeam).await?;
    if !store::triggers::delete(&ctx.data.pool, row.id).await? {
        return Err(ServiceError::NotFound("trigger"));
    }
    audit::record(
        &ctx.data,
        principal,
        Entry::new(Action::TriggerDelete, Some(row.team_id), "trigger", id)
            .details(json!({"name": row.name, "kind": row.kind})),
    )
    .await
}

pub async fn runs(
    ctx: &ServiceContext,
    principal: &Principal,
    id: TriggerId,
    before: Option<TriggerRunId>,
    limit: i64,
) -> ServiceResult<Vec<TriggerRun>> {
    let row = load(ctx, principal, id, Operation::ReadTeam).await?;
    Ok(
        store::triggers::runs(&ctx.data.pool, row.id, before.map(|b| b.uuid()), limit)
            .await?
            .into_iter()
            .map(TriggerRun::from)
            .collect(),
    )
}

// ---- Acting -------------------------------------------------------------------------

/// The person a trigger acts as, with their role in the trigger's team now; `Err` with
/// the reason when they may no longer drive agents there.
async fn acting_as(
    ctx: &ServiceContext,
    row: &TriggerRow,
    run: Uuid,
) -> ServiceResult<Result<Principal, String>> {
    let Some(user) = store::identity::get_user(&ctx.data.pool, row.created_by).await? else {
        return Ok(Err("the trigger's creator no longer exists".into()));
    };
    let teams: Vec<Membership> = store::identity::memberships(&ctx.data.pool, user.id)
        .await?
        .into_iter()
        .filter(|m| m.team_id == row.team_id)
        .filter_map(|m| {
            Role::parse(&m.role).map(|role| Membership {
                team_id: m.team_id,
                team_name: m.team_name,
                role,
            })
        })
        .collect();
    if !user.is_admin && !teams.iter().any(|m| m.role >= Role::Member) {
        return Ok(Err(
            "the trigger's creator may no longer drive agents in its team".into(),
        ));
    }
    Ok(Ok(Principal {
        user_id: user.id,
        email: user.email,
        name: user.name,
        is_admin: user.is_admin,
        token_id: Uuid::nil(),
        // It acts in the trigger's team only.
        service_team: None,
        teams,
        scopes: Vec::new(),
        request_id: Some(format!(
            "{}/{}",
            TriggerId::from(row.id),
            TriggerRunId::from(run)
        )),
        agent: None,
    }))
}

/// What a run did: its outcome, reason, agent and workspace.
struct Done {
    outcome: &'static str,
    reason: Option<String>,
    agent: Option<Uuid>,
    workspace: Option<Uuid>,
}

impl Done {
    fn ignored(reason: impl Into<String>) -> Self {
        Self {
            outcome: "ignored",
            reason: Some(reason.into()),
            agent: None,
            workspace: None,
        }
    }

    fn failed(reason: impl Into<String>) -> Self {
        Self {
            outcome: "failed",
            reason: Some(reason.into()),
            ..Self::ignored("")
        }
    }
}

async fn open_agent(
    ctx: &ServiceContext,
    row: &TriggerRow,
    spec: &Spec,
    principal: &Principal,
    run: Uuid,
    title: String,
    prompt: String,
) -> Done {
    let body = super::agents::CreateAgent {
        workspace_id: None,
        workspace: Some(super::agents::NewWorkspaceSpec {
            project_id: row.project_id.into(),
            base_ref: None,
            branch: None,
        }),
        provider: spec.provider.clone(),
        model: spec.model.clone(),
        mode: spec.mode.clone(),
        title: Some(title),
        labels: json!({"trigger": TriggerId::from(row.id).to_string(),
            "trigger_run": TriggerRunId::from(run).to_string()}),
        prompt: Some(prompt),
        system_prompt: None,
        mcp_servers: json!({}),
        budget: None,
        agentry_mcp: None,
    };
    match super::agents::create(ctx, principal, &body).await {
        Ok(agent) => Done {
            outcome: "started_agent",
            reason: None,
            agent: Some(agent.id.uuid()),
            workspace: Some(agent.workspace_id.uuid()),
        },
        Err(e) => Done::failed(format!("the agent could not be opened: {e}")),
    }
}

async fn send(
    ctx: &ServiceContext,
    principal: &Principal,
    (workspace, agent): (Uuid, Uuid),
    text: String,
) -> Done {
    let body = super::agents::PromptBody {
        text,
        client_message_id: None,
        queue: None,
        interrupt: false,
    };
    match super::agents::prompt(ctx, principal, agent.into(), body).await {
        Ok(accepted) => Done {
            outcome: if accepted.queued {
                "queued"
            } else {
                "sent_message"
            },
            reason: accepted.reason.map(|r| format!("queued: {r}")),
            agent: Some(agent),
            workspace: Some(workspace),
        },
        Err(e) => Done {
            agent: Some(agent),
            workspace: Some(workspace),
            ..Done::failed(format!("the message could not be sent: {e}"))
        },
    }
}

/// The workspace and agent of the pull/merge request a delivery is about.
async fn agent_for(
    ctx: &ServiceContext,
    row: &TriggerRow,
    target: &Target,
) -> ServiceResult<Result<(Uuid, Uuid, i64), String>> {
    let found = match target {
        Target::Number(n) => {
            store::triggers::agent_of_pull_request(&ctx.data.pool, row.project_id, *n)
                .await?
                .map(|(w, a)| (w, a, *n))
        }
        Target::Branch(b) => {
            store::triggers::agent_of_pushed_branch(&ctx.data.pool, row.project_id, b).await?
        }
    };
    let what = match target {
        Target::Number(n) => format!("pull request #{n}"),
        Target::Branch(b) => format!("the pull request of branch `{b}`"),
    };
    Ok(match found {
        None => Err(format!(
            "no workspace of this trigger's project opened {what}"
        )),
        Some((_, None, _)) => Err(format!("the workspace of {what} has no open agent")),
        Some((w, Some(a), n)) => Ok((w, a, n)),
    })
}

async fn act(
    ctx: &ServiceContext,
    row: &TriggerRow,
    spec: &Spec,
    run: Uuid,
    decision: Decision,
) -> ServiceResult<Done> {
    let principal = match acting_as(ctx, row, run).await? {
        Ok(p) => p,
        Err(why) => return Ok(Done::failed(why)),
    };
    let done = match decision {
        Decision::Ignore(why) => Done::ignored(why),
        Decision::OpenAgent { title, prompt } => {
            open_agent(ctx, row, spec, &principal, run, title, prompt).await
        }
        Decision::Comment { target, text } => match agent_for(ctx, row, &target).await? {
            Ok((w, a, _)) => send(ctx, &principal, (w, a), text).await,
            Err(why) => Done::ignored(why),
        },
        Decision::FailedCheck {
            target,
            name,
            excerpt,
            jobs,
            workflow_run,
        } => match agent_for(ctx, row, &target).await? {
            Ok((w, a, number)) => {
                let max = spec
                    .rules
                    .as_ref()
                    .and_then(|r| r.failed_check.as_ref())
                    .map_or(default_excerpt(), |r| r.max_excerpt_bytes);
                let excerpt = match excerpt {
                    Some(e) if jobs.is_empty() && workflow_run.is_none() => Some(e),
                    other => {
                        let logs = match workflow_run {
                            Some(run) => workflow_logs(ctx, row, run, max).await,
                            None => job_logs(ctx, row, &jobs, max).await,
                        };
                        match (other, logs) {
                            (Some(e), Some(l)) => Some(format!("{e}\n\n{l}")),
                            (e, l) => e.or(l),
                        }
                    }
                };
                let mut text = format!("The check `{name}` failed on pull request #{number}.");
                match excerpt {
                    Some(e) => text.push_str(&format!(
                        "\n\nFrom its output:\n\n```\n{}\n```",
                        payload::tail(&e, max)
                    )),
                    None => text.push_str("\n\nThe delivery carried no output of the check."),
                }
                send(ctx, &principal, (w, a), text).await
            }
            Err(why) => Done::ignored(why),
        },
    };
    if done.outcome != "ignored" {
        audit::record(
            &ctx.data,
            &principal,
            Entry::new(
                Action::TriggerRun,
                Some(row.team_id),
                "trigger",
                TriggerId::from(row.id),
            )
            .details(
                json!({"run_id": TriggerRunId::from(run), "outcome": done.outcome,
                "reason": done.reason, "agent_id": done.agent.map(AgentId::from)}),
            ),
        )
        .await?;
    }
    Ok(done)
}

/// The end of the logs of failed GitLab jobs, from the project's forge.
async fn job_logs(
    ctx: &ServiceContext,
    row: &TriggerRow,
    jobs: &[payload::Job],
    max: usize,
) -> Option<String> {
    if jobs.is_empty() {
        return None;
    }
    let project = store::projects::get(&ctx.data.pool, row.project_id, None)
        .await
        .ok()
        .flatten()?;
    let mut parts = Vec::new();
    for job in jobs.iter().take(5) {
        match super::ci::job_log(ctx, &project, job.id).await {
            Ok(log) => parts.push(format!("{}:\n{}", job.name, payload::tail(&log, max))),
            Err(e) => {
                tracing::warn!(trigger_id = %TriggerId::from(row.id), job = job.id, error = %e,
                    "the failed job's log could not be read");
            }
        }
    }
    (!parts.is_empty()).then(|| parts.join("\n\n"))
}

/// Around the first error of the logs of a GitHub workflow run's failed jobs, from the
/// project's forge.
async fn workflow_logs(
    ctx: &ServiceContext,
    row: &TriggerRow,
    run: i64,
    max: usize,
) -> Option<String> {
    let project = store::projects::get(&ctx.data.pool, row.project_id, None)
        .await
        .ok()
        .flatten()?;
    let logs = match super::ci::workflow_run_logs(ctx, &project, run, 5).await {
        Ok(logs) => logs,
        Err(e) => {
            tracing::warn!(trigger_id = %TriggerId::from(row.id), run, error = %e,
                "the failed jobs of a workflow run could not be read");
            return None;
        }
    };
    // Each job gets its share of the excerpt.
    let share = max / logs.len().max(1);
    let parts: Vec<String> = logs
        .into_iter()
        .filter_map(|(name, log)| match log {
            Ok(log) => Some(format!(
                "{name}:\n{}",
                payload::around_first_error(&log, share)
            )),
            Err(e) => {
                tracing::warn!(trigger_id = %TriggerId::from(row.id), run, job = %name, error = %e,
                    "the failed job's log could not be read");
                None
            }
        })
        .collect();
    (!parts.is_empty()).then(|| parts.join("\n\n"))
}

/// Records what attempt `attempt` of run `run` did; `None` when the attempt no longer
/// holds the run.
async fn finish(
    ctx: &ServiceContext,
    run: Uuid,
    attempt: i32,
    done: &Done,
) -> ServiceResult<Option<RunRow>> {
    Ok(store::triggers::finish(
        &ctx.data.pool,
        run,
        attempt,
        done.outcome,
        done.reason.as_deref(),
        done.agent,
        done.workspace,
    )
    .await?)
}

// ---- Webhooks -----------------------------------------------------------------------

/// Records the state or checks a delivery reports of pull/merge requests on the live
/// workspaces of the trigger's project that opened them; a note saying so, when any did.
async fn follow(
    ctx: &ServiceContext,
    row: &TriggerRow,
    forge: ForgeKind,
    event: &str,
    body: &Value,
) -> ServiceResult<Option<String>> {
    let Some(news) = payload::pr_news(forge, event, body) else {
        return Ok(None);
    };
    let mut changed = Vec::new();
    for number in news.numbers.iter().take(20) {
        if store::workspace_remotes::follow_pull_request(
            &ctx.data.pool,
            row.project_id,
            *number,
            news.state,
            news.checks,
        )
        .await?
            > 0
        {
            changed.push(format!("#{number}"));
        }
    }
    if changed.is_empty() {
        return Ok(None);
    }
    let what: Vec<String> = [
        news.state.map(|s| format!("state {s}")),
        news.checks.map(|c| format!("checks {c}")),
    ]
    .into_iter()
    .flatten()
    .collect();
    Ok(Some(format!(
        "recorded {} on the workspace of pull request {}",
        what.join(" and "),
        changed.join(", ")
    )))
}

/// A webhook delivery as received: the headers that matter and the raw body.
pub struct Delivery<'a> {
    /// `X-GitHub-Event` or `X-Gitlab-Event`.
    pub event: Option<&'a str>,
    /// `X-Hub-Signature-256`.
    pub signature: Option<&'a str>,
    /// `X-Gitlab-Token`.
    pub gitlab_token: Option<&'a str>,
    /// `X-GitHub-Delivery`, `X-Gitlab-Event-UUID` or `Idempotency-Key`.
    pub delivery_id: Option<&'a str>,
    pub body: &'a [u8],
}

/// Receives a delivery for trigger `id`: verified and recorded once, as a run that is
/// `pending` when a rule applies (this replica's worker is woken to act on it, or any
/// replica's worker takes it later) and `done` as `ignored` when none does. Returns
/// whether it was received before, and its run: nothing here waits for the forge, the
/// remote or an agent.
pub async fn receive(
    ctx: &ServiceContext,
    id: TriggerId,
    d: Delivery<'_>,
) -> ServiceResult<(bool, TriggerRun)> {
    let row = store::triggers::get(&ctx.data.pool, id.uuid(), None)
        .await?
        .ok_or(ServiceError::NotFound("trigger"))?;
    let Some(forge) = TriggerKind::parse(&row.kind).and_then(TriggerKind::forge) else {
        return Err(ServiceError::NotFound("trigger"));
    };
    let secret = open_secret(ctx, &row).map_err(|why| {
        tracing::error!(trigger_id = %id, error = %why, "a trigger's secret cannot be opened");
        ServiceError::SignatureInvalid("the delivery cannot be verified")
    })?;
    if !verified(forge, &secret, &d) {
        return Err(ServiceError::SignatureInvalid(match forge {
            ForgeKind::GitHub => {
                "X-Hub-Signature-256 is missing or is not the HMAC-SHA256 of the body with the trigger's secret"
            }
            ForgeKind::GitLab => "X-Gitlab-Token is missing or is not the trigger's secret",
        }));
    }
    let delivery_id = match d.delivery_id {
        Some(x) if !x.is_empty() && x.len() <= 200 && !x.chars().any(char::is_control) => {
            x.to_owned()
        }
        Some(_) => {
            return Err(ServiceError::invalid(
                "delivery_id",
                "the delivery id must be 1 to 200 characters",
            ));
        }
        None => format!("sha256:{}", hex::encode(Sha256::digest(d.body))),
    };
    if let Some(first) = store::triggers::by_delivery(&ctx.data.pool, row.id, &delivery_id).await? {
        return Ok((true, first.into()));
    }
    let body: Option<Value> = serde_json::from_slice(d.body).ok();
    let spec = spec_of(&row)?;
    let event = d
        .event
        .map(|e| e.chars().take(100).collect::<String>())
        .unwrap_or_default();
    let decision = if !row.enabled {
        Decision::Ignore("the trigger is disabled".into())
    } else {
        match &body {
            Some(b) if b.is_object() => payload::decide(
                forge,
                &event,
                b,
                spec.rules.as_ref().unwrap_or(&Rules::default()),
            ),
            _ => Decision::Ignore(
                "the body is not a JSON object (choose the content type application/json)".into(),
            ),
        }
    };
    // What the delivery says of pull/merge requests is recorded on the workspaces that
    // opened them, whatever the rules: a single update, nothing asked of the forge.
    let followed = match (&body, row.enabled) {
        (Some(b), true) => follow(ctx, &row, forge, &event, b).await?,
        _ => None,
    };
    let run = Uuid::now_v7();
    let ignored = match (&decision, &followed) {
        (Decision::Ignore(why), Some(note)) => Some(format!("{why}; {note}")),
        (Decision::Ignore(why), None) => Some(why.clone()),
        _ => None,
    };
    let ignored = ignored.as_deref();
    let work = match ignored {
        Some(_) => None,
        None => Some(work_json(&Work {
            decision: decision.clone(),
            note: followed.clone(),
        })?),
    };
    let claimed = store::triggers::claim(
        &ctx.data.pool,
        &store::triggers::NewRun {
            id: run,
            trigger_id: row.id,
            delivery_id: Some(&delivery_id),
            slot: None,
            event: if event.is_empty() { "unknown" } else { &event },
            state: if ignored.is_some() { "done" } else { "pending" },
            work: work.as_ref(),
            lease_s: 0,
            outcome: ignored.map(|_| "ignored"),
            reason: ignored,
        },
    )
    .await?;
    let Some(claimed) = claimed else {
        // The same delivery arrived at the same time: the other one acts.
        let first = store::triggers::by_delivery(&ctx.data.pool, row.id, &delivery_id)
            .await?
            .ok_or(ServiceError::NotFound("trigger run"))?;
        return Ok((true, first.into()));
    };
    if ignored.is_none() {
        ctx.triggers.wake.notify_one();
    }
    Ok((false, claimed.into()))
}

// ---- The worker ---------------------------------------------------------------------

/// What a run is to do, kept with it until it ends (`trigger_runs.work`).
#[derive(Debug, Serialize, Deserialize)]
struct Work {
    decision: Decision,
    /// The run's reason when what it does gives none (a missed slot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    note: Option<String>,
}

fn work_json(work: &Work) -> ServiceResult<Value> {
    serde_json::to_value(work).map_err(|e| ServiceError::Unexpected(e.into()))
}

/// A run is given up as `failed` after this many claims that ended in an error.
const MAX_ATTEMPTS: i32 = 3;

/// This replica's worker: it takes pending runs (and runs whose worker died, once their
/// lease lapsed) and acts on them, a few at a time, each on its own task on the main
/// runtime. It looks when a delivery wakes it, when a run ends, and every few seconds
/// for what other replicas left. On shutdown the runs in hand are given back: they stay
/// pending, and the next worker to look takes them.
pub async fn run_worker(ctx: ServiceContext) {
    let triggers = ctx.triggers.clone();
    let lease = triggers.settings.run_lease_s;
    let look_every = Duration::from_secs(lease)
        .div_f64(3.0)
        .min(Duration::from_secs(10));
    let mut running = tokio::task::JoinSet::new();
    while !*ctx.lifecycle.shutdown.borrow() {
        while running.len() < triggers.settings.max_concurrent_runs {
            match store::triggers::take_unfinished(&ctx.data.pool, lease as i64).await {
                Ok(Some(run)) => {
                    running.spawn_on(attend(ctx.clone(), run), &ctx.lifecycle.runtime);
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "the trigger worker could not look for pending runs");
                    break;
                }
            }
        }
        tokio::select! {
            () = triggers.wake.notified() => {}
            Some(_) = running.join_next(), if !running.is_empty() => {}
            () = tokio::time::sleep(look_every) => {}
            () = ctx.lifecycle.stopping() => break,
        }
    }
    while running.join_next().await.is_some() {}
}

/// Acts on one run this worker took, renewing its lease meanwhile. Cut short by the
/// shutdown, the run is given back as pending; should the lease be lost (the database
/// was out of reach for longer than the lease), the run is left to whoever took it.
async fn attend(ctx: ServiceContext, run: RunRow) {
    let (id, attempt) = (run.id, run.attempt);
    let lease = ctx.triggers.settings.run_lease_s;
    let renew = async {
        loop {
            tokio::time::sleep(Duration::from_secs(lease).div_f64(3.0)).await;
            match store::triggers::renew(&ctx.data.pool, id, attempt, lease as i64).await {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    tracing::warn!(run_id = %TriggerRunId::from(id), error = %e,
                        "the lease of a trigger run could not be renewed");
                }
            }
        }
    };
    tokio::select! {
        result = perform(&ctx, run) => if let Err(e) = result {
            tracing::warn!(run_id = %TriggerRunId::from(id), attempt, error = %e,
                "a trigger run could not be acted on");
            let given_up = if attempt >= MAX_ATTEMPTS {
                finish(&ctx, id, attempt, &Done::failed(format!(
                    "gave up after {attempt} attempts: {e}"))).await.map(|_| ())
            } else {
                store::triggers::release(&ctx.data.pool, id, attempt).await.map_err(Into::into)
            };
            if let Err(e) = given_up {
                tracing::warn!(run_id = %TriggerRunId::from(id), error = %e,
                    "a trigger run that could not be acted on could not be given back");
            }
        },
        () = renew => {
            tracing::warn!(run_id = %TriggerRunId::from(id),
                "the lease of a trigger run was lost; another worker acts on it");
        }
        () = ctx.lifecycle.stopping() => {
            if let Err(e) = store::triggers::release(&ctx.data.pool, id, attempt).await {
                tracing::warn!(run_id = %TriggerRunId::from(id), error = %e,
                    "a trigger run cut short by the shutdown could not be given back; it is taken again once its lease lapses");
            }
        }
    }
}

/// Does what run `run` is to do and records it.
async fn perform(ctx: &ServiceContext, run: RunRow) -> ServiceResult<()> {
    let work = run
        .work
        .clone()
        .map(serde_json::from_value::<Work>)
        .transpose();
    let work = match work {
        Ok(Some(w)) => w,
        Ok(None) | Err(_) => {
            finish(
                ctx,
                run.id,
                run.attempt,
                &Done::failed("the run's work cannot be read"),
            )
            .await?;
            return Ok(());
        }
    };
    let Some(row) = store::triggers::get(&ctx.data.pool, run.trigger_id, None).await? else {
        // Deleted meanwhile: its runs went with it.
        return Ok(());
    };
    let spec = spec_of(&row)?;
    let mut done = act(ctx, &row, &spec, run.id, work.decision).await?;
    if done.reason.is_none() {
        done.reason = work.note;
    }
    if finish(ctx, run.id, run.attempt, &done).await?.is_none() {
        tracing::warn!(run_id = %TriggerRunId::from(run.id),
            "a trigger run was acted on after its lease was lost");
    }
    Ok(())
}

// ---- Schedules ----------------------------------------------------------------------

/// Runs the due slots of every enabled cron trigger at `now`.
async fn tick(ctx: &ServiceContext, now: DateTime<Utc>) -> ServiceResult<()> {
    let late_after = chrono::Duration::seconds(ctx.triggers.settings.missed_after_s as i64);
    for row in store::triggers::enabled_schedules(&ctx.data.pool).await? {
        if *ctx.lifecycle.shutdown.borrow() {
            break;
        }
        if let Err(e) = slot(ctx, &row, now, late_after).await {
            tracing::warn!(trigger_id = %TriggerId::from(row.id), error = %e,
                "a scheduled trigger could not run");
        }
    }
    Ok(())
}

async fn slot(
    ctx: &ServiceContext,
    row: &TriggerRow,
    now: DateTime<Utc>,
    late_after: chrono::Duration,
) -> ServiceResult<()> {
    let spec = spec_of(row)?;
    let (Some(schedule), Some(prompt)) = (&spec.schedule, &spec.prompt) else {
        return Ok(());
    };
    let tz = cron::time_zone(spec.time_zone.as_deref().unwrap_or("UTC"))
        .map_err(|e| ServiceError::Unexpected(anyhow::anyhow!(e)))?;
    let schedule =
        Schedule::parse(schedule).map_err(|e| ServiceError::Unexpected(anyhow::anyhow!(e)))?;
    let Some(latest) = schedule.latest_at_or_before(&tz, now) else {
        return Ok(());
    };
    let considered = row.last_slot.unwrap_or(row.created_at);
    if latest <= considered {
        return Ok(());
    }
    let late = now - latest > late_after;
    let skip = late && spec.missed == Some(Missed::Skip);
    let reason = match (late, skip) {
        (true, true) => Some(format!(
            "slot {latest} was missed while no replica ran; skipped (missed = skip)"
        )),
        (true, false) => Some(format!(
            "slot {latest} was missed while no replica ran; run once now (missed = run_once)"
        )),
        _ => None,
    };
    let run = Uuid::now_v7();
    let title = format!("{} at {}", row.name, latest.format("%Y-%m-%d %H:%M UTC"));
    let work = Work {
        decision: Decision::OpenAgent {
            title,
            prompt: prompt.clone(),
        },
        note: reason.clone(),
    };
    let work_value = (!skip).then(|| work_json(&work)).transpose()?;
    // The scheduler acts on its slot itself, under a lease: should this replica die
    // meanwhile, a worker takes the run once the lease lapses.
    let claimed = store::triggers::claim(
        &ctx.data.pool,
        &store::triggers::NewRun {
            id: run,
            trigger_id: row.id,
            delivery_id: None,
            slot: Some(latest),
            event: "schedule",
            state: if skip { "done" } else { "running" },
            work: work_value.as_ref(),
            lease_s: ctx.triggers.settings.run_lease_s as i64,
            outcome: skip.then_some("ignored"),
            reason: if skip { reason.as_deref() } else { None },
        },
    )
    .await?;
    if let Some(claimed) = claimed
        && !skip
    {
        let mut done = act(ctx, row, &spec, run, work.decision).await?;
        if done.reason.is_none() {
            done.reason = work.note;
        }
        finish(ctx, run, claimed.attempt, &done).await?;
    }
    store::triggers::advance_slot(&ctx.data.pool, row.id, latest).await?;
    Ok(())
}

/// The scheduler of this replica: at every minute (or, with a manual clock, whenever it
/// moves) it runs the slots that are due. A slot is claimed in the database, so with
/// several replicas each runs once.
pub async fn run_scheduler(ctx: ServiceContext) {
    let triggers: Arc<Triggers> = ctx.triggers.clone();
    let mut manual = triggers.manual.as_ref().map(|m| m.subscribe());
    loop {
        let now = match &mut manual {
            Some(rx) => *rx.borrow_and_update(),
            None => Utc::now(),
        };
        if let Err(e) = tick(&ctx, now).await {
            tracing::warn!(error = %e, "the trigger scheduler could not look at the schedules");
        }
        triggers.handled.send_replace(Some(now));
        match &mut manual {
            Some(rx) => tokio::select! {
                changed = rx.changed() => if changed.is_err() { return },
                _ = ctx.lifecycle.stopping() => return,
            },
            None => {
                // Just past the next whole minute, when slots fall due.
                let into_minute = Utc::now().timestamp_subsec_millis() as u64
                    + (Utc::now().timestamp().rem_euclid(60) as u64) * 1000;
                let wait = Duration::from_millis(60_000 - into_minute.min(59_999) + 250);
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = ctx.lifecycle.stopping() => return,
                }
            }
        }
    }
}
