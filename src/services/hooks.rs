//! Lifecycle hooks: webhooks a team (or the server) registers for the 15 points of
//! `HookEvent`. Team owners manage their team's hooks, server admins the server-wide
//! ones (some of which come from the settings file and are read-only here). Waiting
//! hooks are called synchronously by the operation they guard (`call_waiting`) and may
//! replace its request; notifications go to a durable outbox (`notify`) that a worker
//! delivers with retries (`run_worker`). A hook's secret is sealed at rest like a team
//! secret and never shown again; launch `env` from hooks is never stored.

mod delivery;

pub(crate) use delivery::PublicOnly;
pub use delivery::{Caller, check_url, is_internal, signature};

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::sync::Notify;
use utoipa::ToSchema;
use uuid::Uuid;

use super::audit::{self, Action, Entry};
use super::{ServiceContext, ServiceError, ServiceResult};
use crate::auth::{Operation, Principal, Role};
use crate::config::{FileHook, HookSettings, valid_env_name};
use crate::domain::{DeliveryId, HookEvent, HookId, ProjectId, SecretEnv, SecretValue, TeamId};
use crate::metrics::{Counter, Family};
use crate::runtime::Moment;
use crate::store;
use crate::store::hooks::{CallableHook, HookRow};

/// Notifications are retried for at least this long before they are `failed`.
pub const RETRY_WINDOW_S: f64 = 600.0;

/// At most this many variables may come from hooks for one launch.
const MAX_HOOK_ENV: usize = 100;

/// The running hooks machinery the services share: the HTTP clients and settings, and the
/// worker's wake-up bell.
pub struct Hooks {
    caller: Caller,
    wake: Notify,
    /// Delivery attempts by outcome (`delivered`, `retry`, `failed`), for `/metrics`.
    pub deliveries: Family<Counter>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks").finish_non_exhaustive()
    }
}

impl Hooks {
    pub fn new(settings: &HookSettings) -> anyhow::Result<Self> {
        Ok(Self {
            caller: Caller::new(settings)?,
            wake: Notify::new(),
            deliveries: Family::counters(&["outcome"]),
        })
    }

    fn settings(&self) -> &HookSettings {
        self.caller.settings()
    }

    /// Rows were queued in the outbox: wake the delivery worker.
    pub(crate) fn queued(&self) {
        self.wake.notify_one();
    }
}

// ---- API types -----------------------------------------------------------------------

/// `Some(None)` for an explicit `null`, `None` when the field is absent.
fn explicit<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// The body of `POST /v1/hooks`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "ticket-bot", "events": ["agent.turn.after"],
    "url": "https://hooks.example.com/agentry", "secret": "whsec_…",
    "team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "labels": {"ci": "true"}}))]
pub struct CreateHook {
    pub name: String,
    /// Lifecycle points, e.g. `agent.turn.after`.
    pub events: Vec<String>,
    /// `http://` or `https://`; a team's hook may not target loopback, private or
    /// link-local addresses (unless `hooks.allow_private_networks`).
    pub url: String,
    /// Signs every delivery (HMAC-SHA256). Write-only: never returned.
    #[schema(value_type = String)]
    pub secret: SecretValue,
    /// The team (default: the caller's team); `null` makes a server-wide hook (admins).
    #[serde(default, deserialize_with = "explicit")]
    #[schema(value_type = Option<String>)]
    pub team_id: Option<Option<TeamId>>,
    /// Only for workspaces and agents of this project.
    pub project_id: Option<ProjectId>,
    /// Only for agents carrying all of these labels.
    #[schema(value_type = Option<Object>)]
    pub labels: Option<Value>,
    pub enabled: Option<bool>,
}

/// The body of `PATCH /v1/hooks/{id}`: what is given changes.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"enabled": false}))]
pub struct PatchHook {
    pub name: Option<String>,
    pub events: Option<Vec<String>>,
    pub url: Option<String>,
    #[schema(value_type = Option<String>)]
    pub secret: Option<SecretValue>,
    /// `null` removes the project filter.
    #[serde(default, deserialize_with = "explicit")]
    #[schema(value_type = Option<String>)]
    pub project_id: Option<Option<ProjectId>>,
    #[schema(value_type = Option<Object>)]
    pub labels: Option<Value>,
    pub enabled: Option<bool>,
}

/// A hook as clients see it (never its secret).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"id": "hook_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "name": "ticket-bot",
    "events": ["agent.turn.after"], "url": "https://hooks.example.com/agentry",
    "team_id": "team_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c", "project_id": null, "labels": {},
    "enabled": true, "source": "api", "created_at": "2026-12-01T12:00:00Z"}))]
pub struct Hook {
    pub id: HookId,
    pub name: String,
    pub events: Vec<String>,
    pub url: String,
    /// Null for a server-wide hook.
    pub team_id: Option<TeamId>,
    pub project_id: Option<ProjectId>,
    #[schema(value_type = Object)]
    pub labels: Value,
    pub enabled: bool,
    /// `api`, or `settings` for a hook of the settings file (read-only here).
    pub source: String,
    pub created_at: DateTime<Utc>,
}

impl From<HookRow> for Hook {
    fn from(r: HookRow) -> Self {
        Self {
            id: r.id.into(),
            name: r.name,
            events: r.events,
            url: r.url,
            team_id: r.team_id.map(Into::into),
            project_id: r.project_id.map(Into::into),
            labels: r.labels,
            enabled: r.enabled,
            source: if r.settings_position.is_some() {
                "settings".into()
            } else {
                "api".into()
            },
            created_at: r.created_at,
        }
    }
}

/// One delivery of a hook (a notification with its retries, or one waiting call).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"id": "dlv_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "hook": "agent.turn.after",
    "status": "delivered", "attempts": 1, "response_status": 204, "error": null,
    "duration_ms": 38, "created_at": "2026-12-01T12:00:00Z", "delivered_at": "2026-12-01T12:00:00Z"}))]
pub struct Delivery {
    pub id: DeliveryId,
    /// The lifecycle point.
    pub hook: String,
    /// `pending`, `delivered` or `failed`.
    pub status: String,
    pub attempts: i32,
    pub response_status: Option<i32>,
    pub error: Option<String>,
    pub duration_ms: Option<i32>,
    pub created_at: DateTime<Utc>,
    pub delivered_at: Option<DateTime<Utc>>,
}

impl From<store::hooks::DeliveryRow> for Delivery {
    fn from(r: store::hooks::DeliveryRow) -> Self {
        Self {
            id: r.id.into(),
            hook: r.event,
            status: r.status,
            attempts: r.attempts,
            response_status: r.response_status,
            error: r.error,
            duration_ms: r.duration_ms,
            created_at: r.created_at,
            delivered_at: r.delivered_at,
        }
    }
}

// ---- validation ----------------------------------------------------------------------

fn check_name(name: &str) -> ServiceResult<()> {
    if name.trim().is_empty() || name.len() > 100 || name.chars().any(char::is_control) {
        return Err(ServiceError::invalid(
            "name",
            "must be 1 to 100 characters, no control characters",
        ));
    }
    Ok(())
}

fn check_events(events: &[String]) -> ServiceResult<Vec<String>> {
    if events.is_empty() {
        return Err(ServiceError::invalid("events", "name at least one event"));
    }
    let mut out: Vec<String> = Vec::new();
    for e in events {
        let Some(ev) = HookEvent::parse(e) else {
            return Err(ServiceError::invalid(
                "events",
                format!(
                    "`{e}` is not a hook event; the events are {}",
                    HookEvent::ALL.map(HookEvent::as_str).join(", ")
                ),
            ));
        };
        if !out.iter().any(|o| o == ev.as_str()) {
            out.push(ev.as_str().to_owned());
        }
    }
    Ok(out)
}

fn check_labels(labels: &Value) -> ServiceResult<()> {
    match labels.as_object() {
        Some(m)
            if m.len() <= 50
                && m.iter()
                    .all(|(k, v)| !k.is_empty() && k.len() <= 100 && v.is_string()) =>
        {
            Ok(())
        }
        _ => Err(ServiceError::invalid(
            "labels",
            "an object of at most 50 string values; keys 1 to 100 characters",
        )),
    }
}

fn check_secret(secret: &SecretValue) -> ServiceResult<()> {
    let n = secret.expose().len();
    if n == 0 || n > 1024 {
        return Err(ServiceError::invalid("secret", "must be 1 to 1024 bytes"));
    }
    Ok(())
}

/// The sealing context of a hook's secret: its team (nil for server-wide) and its id.
fn seal_name(id: Uuid) -> String {
    format!("hook:{}", HookId::from(id))
}

fn seal(
    ctx: &ServiceContext,
    team: Option<Uuid>,
    id: Uuid,
    secret: &SecretValue,
) -> super::secrets::Sealed {
    ctx.access
        .secrets
        .seal(team.unwrap_or(Uuid::nil()), &seal_name(id), secret)
}

fn open_secret(
    ctx: &ServiceContext,
    team: Option<Uuid>,
    id: Uuid,
    key_id: &str,
    nonce: &[u8],
    ciphertext: &[u8],
) -> Result<SecretValue, String> {
    let sealed = super::secrets::Sealed {
        key_id: key_id.to_owned(),
        nonce: nonce.to_vec(),
        ciphertext: ciphertext.to_vec(),
    };
    ctx.access
        .secrets
        .open(team.unwrap_or(Uuid::nil()), &seal_name(id), &sealed)
        .map_err(|e| format!("its secret cannot be decrypted: {e}"))
}

/// A project filter names a project of the hook's team (any project for a server hook).
async fn check_project(
    ctx: &ServiceContext,
    principal: &Principal,
    team: Option<Uuid>,
    project: ProjectId,
) -> ServiceResult<Uuid> {
    let row = super::projects::find(&ctx.data, principal, project).await?;
    if let Some(team) = team
        && row.team_id != team
    {
        return Err(ServiceError::NotFound("project"));
    }
    Ok(row.id)
}

// ---- CRUD ----------------------------------------------------------------------------

/// The team a new hook belongs to: the one named, the caller's own when none is named,
/// or none (server-wide) for `null`.
fn target_team(principal: &Principal, body: &CreateHook) -> ServiceResult<Option<Uuid>> {
    match body.team_id {
        Some(Some(t)) => {
            principal.authorize_in(t.uuid(), Operation::ManageTeam, "team")?;
            Ok(Some(t.uuid()))
        }
        Some(None) => {
            principal.authorize(Operation::AdministerServer)?;
            Ok(None)
        }
        None => match principal.default_team() {
            Some(t) => {
                principal.authorize_in(t, Operation::ManageTeam, "team")?;
                Ok(Some(t))
            }
            None if principal.is_server_admin() => Ok(None),
            None => Err(ServiceError::invalid(
                "team_id",
                "required: the caller belongs to no team",
            )),
        },
    }
}

#[tracing::instrument(name = "services::hooks::create", skip_all)]
pub async fn create(
    ctx: &ServiceContext,
    principal: &Principal,
    body: &CreateHook,
) -> ServiceResult<Hook> {
    principal.authorize(Operation::ManageTeam)?;
    let team = target_team(principal, body)?;
    check_name(&body.name)?;
    let events = check_events(&body.events)?;
    delivery::check_url(&body.url, team.is_some(), ctx.hooks.settings())
        .map_err(|m| ServiceError::invalid("url", m))?;
    check_secret(&body.secret)?;
    let labels = body.labels.clone().unwrap_or_else(|| json!({}));
    check_labels(&labels)?;
    let project = match body.project_id {
        Some(p) => Some(check_project(ctx, principal, team, p).await?),
        None => None,
    };
    let id = Uuid::now_v7();
    let sealed = seal(ctx, team, id, &body.secret);
    let row = store::hooks::insert(
        &ctx.data.pool,
        &store::hooks::NewHook {
            id,
            team_id: team,
            name: &body.name,
            events: &events,
            url: &body.url,
            key_id: &sealed.key_id,
            nonce: &sealed.nonce,
            ciphertext: &sealed.ciphertext,
            project_id: project,
            labels: &labels,
            enabled: body.enabled.unwrap_or(true),
            settings_position: None,
            created_by: Some(principal.user_id),
        },
    )
    .await?;
    let hook = Hook::from(row);
    audit::record(
        &ctx.data,
        principal,
        Entry::new(Action::HookCreate, team, "hook", hook.id).details(
            json!({"name": hook.name, "events": hook.events, "url": hook.url, "enabled": hook.enabled}),
        ),
    )
    .await?;
    Ok(hook)
}

/// The hook, when the caller may manage it: an owner of its team, or a server admin for
/// a server-wide hook. Another team's hook is missing; a server hook is missing for
/// anyone but an admin.
async fn load(
    ctx: &ServiceContext,
    principal: &Principal,
    id: HookId,
    op: Operation,
) -> ServiceResult<HookRow> {
    principal.authorize(op)?;
    let teams = principal.visible_teams();
    let row = store::hooks::get(&ctx.data.pool, id.uuid(), teams.as_deref())
        .await?
        .ok_or(ServiceError::NotFound("hook"))?;
    match row.team_id {
        Some(team) => principal.authorize_in(team, op, "hook")?,
        None if principal.is_server_admin() => {}
        None => return Err(ServiceError::NotFound("hook")),
    }
    Ok(row)
}

#[tracing::instrument(name = "services::hooks::get", skip_all, fields(hook_id = %id))]
pub async fn get(ctx: &ServiceContext, principal: &Principal, id: HookId) -> ServiceResult<Hook> {
    Ok(load(ctx, principal, id, Operation::ReadAsOwner)
        .await?
        .into())
}

/// The hooks the caller manages: its teams' (where it is an owner), and for a server
/// admin every hook.
#[tracing::instrument(name = "services::hooks::list", skip_all)]
pub async fn list(
    ctx: &ServiceContext,
    principal: &Principal,
    after: Option<HookId>,
    limit: i64,
) -> ServiceResult<Vec<Hook>> {
    principal.authorize(Operation::ReadAsOwner)?;
    let rows = if principal.is_server_admin() {
        store::hooks::list(&ctx.data.pool, None, true, after.map(|a| a.uuid()), limit).await?
    } else {
        let owned: Vec<Uuid> = principal
            .teams
            .iter()
            .filter(|m| m.role == Role::Owner)
            .map(|m| m.team_id)
            .filter(|t| principal.service_team.is_none_or(|s| s == *t))
            .collect();
        store::hooks::list(
            &ctx.data.pool,
            Some(&owned),
            false,
            after.map(|a| a.uuid()),
            limit,
        )
        .await?
    };
    Ok(rows.into_iter().map(Hook::from).collect())
}

fn read_only(row: &HookRow) -> ServiceResult<()> {
    if row.settings_position.is_some() {
        return Err(ServiceError::HookReadOnly);
    }
    Ok(())
}

#[tracing::instrument(name = "services::hooks::update", skip_all, fields(hook_id = %id))]
pub async fn update(
    ctx: &ServiceContext,
    principal: &Principal,
    id: HookId,
    body: &PatchHook,
) -> ServiceResult<Hook> {
    let row = load(ctx, principal, id, Operation::ManageTeam).await?;
    read_only(&row)?;
    if let Some(n) = &body.name {
        check_name(n)?;
    }
    let events = body.events.as_deref().map(check_events).transpose()?;
    if let Some(u) = &body.url {
        delivery::check_url(u, row.team_id.is_some(), ctx.hooks.settings())
            .map_err(|m| ServiceError::invalid("url", m))?;
    }
    if let Some(s) = &body.secret {
        check_secret(s)?;
    }
    if let Some(l) = &body.labels {
        check_labels(l)?;
    }
    let project = match body.project_id {
        Some(Some(p)) => Some(Some(check_project(ctx, principal, row.team_id, p).await?)),
        Some(None) => Some(None),
        None => None,
    };
    let sealed = body
        .secret
        .as_ref()
        .map(|s| seal(ctx, row.team_id, row.id, s));
    let updated = store::hooks::update(
        &ctx.data.pool,
        row.id,
        &store::hooks::HookChange {
            name: body.name.as_deref(),
            events: events.as_deref(),
            url: body.url.as_deref(),
            sealed: sealed.as_ref().map(|s| {
                (
                    s.key_id.as_str(),
                    s.nonce.as_slice(),
                    s.ciphertext.as_slice(),
                )
            }),
            project_id: project,
            labels: body.labels.as_ref(),
            enabled: body.enabled,
        },
    )
    .await?
    .ok_or(ServiceError::NotFound("hook"))?;
    let hook = Hook::from(updated);
    let mut changed: Vec<&str> = Vec::new();
    for (f, set) in [
        ("name", body.name.is_some()),
        ("events", body.events.is_some()),
        ("url", body.url.is_some()),
        ("secret", body.secret.is_some()),
        ("project_id", body.project_id.is_some()),
        ("labels", body.labels.is_some()),
        ("enabled", body.enabled.is_some()),
    ] {
        if set {
            changed.push(f);
        }
    }
    audit::record(
        &ctx.data,
        principal,
        Entry::new(Action::HookUpdate, row.team_id, "hook", hook.id)
            .details(json!({"changed": changed, "enabled": hook.enabled})),
    )
    .await?;
    Ok(hook)
}

#[tracing::instrument(name = "services::hooks::delete", skip_all, fields(hook_id = %id))]
pub async fn delete(ctx: &ServiceContext, principal: &Principal, id: HookId) -> ServiceResult<()> {
    let row = load(ctx, principal, id, Operation::ManageTeam).await?;
    read_only(&row)?;
    if !store::hooks::delete(&ctx.data.pool, row.id).await? {
        return Err(ServiceError::NotFound("hook"));
    }
    audit::record(
        &ctx.data,
        principal,
        Entry::new(Action::HookDelete, row.team_id, "hook", id).details(json!({"name": row.name})),
    )
    .await
}

#[tracing::instrument(name = "services::hooks::deliveries", skip_all, fields(hook_id = %id))]
pub async fn deliveries(
    ctx: &ServiceContext,
    principal: &Principal,
    id: HookId,
    before: Option<DeliveryId>,
    limit: i64,
) -> ServiceResult<Vec<Delivery>> {
    let row = load(ctx, principal, id, Operation::ReadAsOwner).await?;
    let rows =
        store::hooks::deliveries(&ctx.data.pool, row.id, before.map(|d| d.uuid()), limit).await?;
    Ok(rows.into_iter().map(Delivery::from).collect())
}

#[tracing::instrument(name = "services::hooks::redeliver", skip_all, fields(hook_id = %id, delivery_id = %delivery))]
pub async fn redeliver(
    ctx: &ServiceContext,
    principal: &Principal,
    id: HookId,
    delivery: DeliveryId,
) -> ServiceResult<()> {
    let row = load(ctx, principal, id, Operation::ManageTeam).await?;
    let waiting: Vec<&str> = HookEvent::ALL
        .into_iter()
        .filter(|e| e.waits())
        .map(HookEvent::as_str)
        .collect();
    // A waiting hook's call belonged to its operation, which is over: only
    // notifications are sent again.
    if !store::hooks::redeliver(
        &ctx.data.pool,
        row.id,
        delivery.uuid(),
        RETRY_WINDOW_S,
        &waiting,
    )
    .await?
    {
        return Err(ServiceError::NotFound("delivery"));
    }
    ctx.hooks.wake.notify_one();
    Ok(())
}

/// Re-encrypt the hook secrets that are not under the current key (`agentry secrets
/// rotate`). Returns how many were re-encrypted, and the hooks whose secret cannot be
/// opened with any key the server has.
#[tracing::instrument(name = "services::hooks::rotate", skip_all)]
pub async fn rotate(
    pool: &sqlx::PgPool,
    keys: &super::secrets::Keyring,
) -> Result<(usize, Vec<(HookId, super::secrets::OpenError)>), sqlx::Error> {
    super::secrets::rotate_sealed(pool, keys, store::sealed::SealedIn::Hooks, seal_name).await
}

// ---- settings-file hooks -------------------------------------------------------------

/// The id of a settings-file hook: derived from its name, so it is the same at every
/// start and its deliveries keep their hook.
pub fn settings_hook_id(name: &str) -> Uuid {
    let digest = Sha256::new()
        .chain_update(b"agentry settings hook\0")
        .chain_update(name.as_bytes())
        .finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    // A version 8 (custom) UUID.
    bytes[6] = (bytes[6] & 0x0f) | 0x80;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    Uuid::from_bytes(bytes)
}

/// Make the server-wide hooks of the settings file what the database holds: insert or
/// update each (its secret sealed anew), delete the ones the file no longer lists.
#[tracing::instrument(name = "services::hooks::sync_settings_hooks", skip_all)]
pub async fn sync_settings_hooks(ctx: &ServiceContext, hooks: &[FileHook]) -> anyhow::Result<()> {
    let mut keep = Vec::new();
    for (i, h) in hooks.iter().enumerate() {
        let at = format!("hooks.server[{i}]");
        let events = check_events(&h.events)
            .map_err(|e| anyhow::anyhow!("invalid setting `{at}.events`: {e}"))?;
        delivery::check_url(&h.url, false, ctx.hooks.settings())
            .map_err(|m| anyhow::anyhow!("invalid setting `{at}.url`: {m}"))?;
        let labels = serde_json::to_value(&h.labels)?;
        let project = match &h.project_id {
            Some(p) => {
                let p: ProjectId = p.parse().map_err(|_| {
                    anyhow::anyhow!("invalid setting `{at}.project_id`: not a project id")
                })?;
                if store::projects::get(&ctx.data.pool, p.uuid(), None)
                    .await?
                    .is_none()
                {
                    anyhow::bail!("invalid setting `{at}.project_id`: no project {p}");
                }
                Some(p.uuid())
            }
            None => None,
        };
        let id = settings_hook_id(&h.name);
        let sealed = seal(ctx, None, id, &SecretValue::new(h.secret.expose()));
        store::hooks::insert(
            &ctx.data.pool,
            &store::hooks::NewHook {
                id,
                team_id: None,
                name: &h.name,
                events: &events,
                url: &h.url,
                key_id: &sealed.key_id,
                nonce: &sealed.nonce,
                ciphertext: &sealed.ciphertext,
                project_id: project,
                labels: &labels,
                enabled: h.enabled,
                settings_position: Some(i as i32),
                created_by: None,
            },
        )
        .await?;
        keep.push(id);
    }
    store::hooks::delete_settings_hooks_except(&ctx.data.pool, &keep).await?;
    Ok(())
}

// ---- matching and bodies -------------------------------------------------------------

/// What an operation is about, to match hook filters.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Subject<'a> {
    pub team: Uuid,
    pub project: Option<Uuid>,
    /// The agent's labels, for agent events (a hook with labels only hears agents).
    pub labels: Option<&'a Value>,
    /// The team's hooks, when the operation read them already (one that calls or queues
    /// several events reads them once); else they are read for this event.
    pub among: Option<&'a TeamHooks>,
}

/// The enabled hooks that concern one team, of every event, as read once.
#[derive(Debug)]
pub(crate) struct TeamHooks(Vec<CallableHook>);

impl TeamHooks {
    pub(crate) async fn load(data: &super::Data, team: Uuid) -> ServiceResult<Self> {
        Ok(Self(store::hooks::for_team(&data.pool, team).await?))
    }

    /// Those of `event` that concern `subject`, in calling order.
    fn of(&self, event: HookEvent, subject: &Subject<'_>) -> Vec<CallableHook> {
        self.0
            .iter()
            .filter(|h| h.hook.events.iter().any(|e| e == event.as_str()))
            .filter(|h| matches(&h.hook, subject))
            .cloned()
            .collect()
    }
}

fn matches(hook: &HookRow, subject: &Subject<'_>) -> bool {
    if let (Some(want), Some(p)) = (hook.project_id, subject.project)
        && want != p
    {
        return false;
    }
    let wanted = hook.labels.as_object().filter(|m| !m.is_empty());
    match (wanted, subject.labels.and_then(Value::as_object)) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(w), Some(have)) => w.iter().all(|(k, v)| have.get(k) == Some(v)),
    }
}

async fn hooks_for(
    ctx: &ServiceContext,
    event: HookEvent,
    subject: &Subject<'_>,
) -> ServiceResult<Vec<CallableHook>> {
    if let Some(known) = subject.among {
        return Ok(known.of(event, subject));
    }
    let all = store::hooks::for_event(&ctx.data.pool, event.as_str(), subject.team).await?;
    Ok(all
        .into_iter()
        .filter(|h| matches(&h.hook, subject))
        .collect())
}

fn body_of(id: Uuid, event: HookEvent, team: Uuid, payload: Value) -> String {
    json!({
        "id": DeliveryId::from(id),
        "hook": event.as_str(),
        "at": Utc::now(),
        "team_id": TeamId::from(team),
        "payload": payload,
    })
    .to_string()
}

// ---- notifications -------------------------------------------------------------------

/// Queue `event` with `payload` in the outbox for every enabled hook it concerns, on
/// `conn`: inside the transaction of the operation it tells of, so the notification
/// exists exactly when the operation's result does (a crash cannot keep one without the
/// other). Call `queued` once that transaction commits, to wake the worker.
#[tracing::instrument(name = "services::hooks::queue", skip_all)]
pub(crate) async fn queue(
    conn: &mut sqlx::PgConnection,
    event: HookEvent,
    subject: Subject<'_>,
    payload: Value,
) -> ServiceResult<usize> {
    let hooks: Vec<CallableHook> = match subject.among {
        Some(known) => known.of(event, &subject),
        None => store::hooks::for_event(&mut *conn, event.as_str(), subject.team)
            .await?
            .into_iter()
            .filter(|h| matches(&h.hook, &subject))
            .collect(),
    };
    for h in &hooks {
        let id = Uuid::now_v7();
        let body = body_of(id, event, subject.team, payload.clone());
        store::hooks::insert_delivery(
            &mut *conn,
            &store::hooks::NewDelivery {
                id,
                hook_id: h.hook.id,
                hook_name: &h.hook.name,
                event: event.as_str(),
                team_id: Some(subject.team),
                body: &body,
                retry_for_s: RETRY_WINDOW_S,
            },
        )
        .await?;
    }
    Ok(hooks.len())
}

/// How often stored moments are looked for without a wake-up from the writer (moments
/// of other replicas, and those a crash left behind).
const MOMENT_SWEEP: Duration = Duration::from_secs(1);

/// Moments turned into outbox rows per transaction.
const MOMENT_BATCH: i64 = 256;

/// Turn the agents' stored moments into outbox rows as they are committed (the writer
/// rings after each batch with moments), at start and every `MOMENT_SWEEP`; runs until
/// the server ends the task.
pub async fn run_moments(ctx: ServiceContext) {
    loop {
        if let Err(e) = outbox_moments(&ctx).await {
            tracing::warn!(error = %e, "could not queue the notifications of agents' moments; retrying");
        }
        tokio::select! {
            _ = ctx.data.writer.moments_stored() => {}
            _ = tokio::time::sleep(MOMENT_SWEEP) => {}
        }
    }
}

/// Turn every stored moment no other replica holds into the outbox rows of the hooks it
/// concerns, deleting it in the same transaction. Returns how many moments were handled.
#[tracing::instrument(name = "services::hooks::outbox_moments", skip_all)]
pub async fn outbox_moments(ctx: &ServiceContext) -> ServiceResult<usize> {
    // Without a hook that listens, the writer stores no moment but still rings after
    // each turn's start and end: one read then, not a transaction of three statements.
    if !store::hooks::any_moment(ctx.data.pool.pool()).await? {
        return Ok(0);
    }
    let mut handled = 0;
    loop {
        let mut tx = ctx.data.pool.pool().begin().await?;
        let claimed = store::hooks::claim_moments(&mut tx, MOMENT_BATCH).await?;
        if claimed.is_empty() {
            return Ok(handled);
        }
        // Read what each moment is; one query then says which of them any hook hears.
        let known: Vec<(&store::hooks::MomentRow, Moment, HookEvent)> = claimed
            .iter()
            .filter_map(|stored| {
                let Some(m) = Moment::stored(&stored.kind, stored.payload.clone()) else {
                    tracing::error!(kind = %stored.kind, "a stored moment of an unknown kind; it is dropped");
                    return None;
                };
                let event = m.hook_event();
                Some((stored, m, event))
            })
            .collect();
        let asked: Vec<(i64, Uuid, &str)> = known
            .iter()
            .map(|(stored, _, event)| (stored.id, stored.agent_id, event.as_str()))
            .collect();
        let listened = store::hooks::listened_moments(&mut *tx, &asked).await?;
        let mut queued_any = 0;
        for (stored, m, event) in known {
            if listened.contains(&stored.id) {
                queued_any += moment(ctx, &mut tx, stored, m, event).await?;
            }
        }
        let ids: Vec<i64> = claimed.iter().map(|m| m.id).collect();
        store::hooks::delete_moments(&mut tx, &ids).await?;
        tx.commit().await?;
        handled += claimed.len();
        if queued_any > 0 {
            ctx.hooks.queued();
        }
    }
}

/// Queue the notification of one stored moment, which some hook listens for.
async fn moment(
    ctx: &ServiceContext,
    conn: &mut sqlx::PgConnection,
    stored: &store::hooks::MomentRow,
    m: Moment,
    event: HookEvent,
) -> ServiceResult<usize> {
    let Some(row) = store::agents::get(&mut *conn, stored.agent_id, None).await? else {
        return Ok(0);
    };
    let labels = row.labels.clone();
    let (team, project) = (row.team_id, row.project_id);
    let subject = Subject {
        team,
        project: Some(project),
        labels: Some(&labels),
        among: None,
    };
    let agent = super::agents::to_agent(ctx, row);
    let payload = match m {
        Moment::TurnStarted { turn_id } => json!({"agent": agent, "turn_id": turn_id}),
        Moment::TurnEnded {
            turn_id,
            outcome,
            error,
        } => {
            json!({"agent": agent, "turn_id": turn_id, "outcome": outcome.as_str(), "error": error})
        }
        Moment::PermissionRequested { request_id } => {
            let view = store::permissions::get(&mut *conn, stored.agent_id, request_id.uuid())
                .await?
                .map(super::agents::PermissionView::from);
            json!({"agent": agent, "request": view})
        }
        Moment::PermissionResolved {
            request_id,
            resolution,
        } => json!({"agent": agent, "request_id": request_id, "resolution": resolution}),
        Moment::Closed {} => json!({"agent": agent}),
    };
    queue(conn, event, subject, payload).await
}

/// Deliver due notifications until the server stops: claim a few (skipping rows another
/// replica holds), send them concurrently, record each attempt; retry with backoff until
/// the retry window closes, then mark `failed`.
pub async fn run_worker(ctx: ServiceContext) {
    let lease = (ctx.hooks.settings().timeout_s + 30) as f64;
    loop {
        if *ctx.lifecycle.shutdown.borrow() {
            return;
        }
        let claimed = match store::hooks::claim_due(ctx.data.pool.pool(), 16, lease).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "could not claim hook deliveries");
                Vec::new()
            }
        };
        let busy = !claimed.is_empty();
        let sends = claimed.into_iter().map(|d| {
            let ctx = ctx.clone();
            async move { attempt(&ctx, d).await }
        });
        tokio::select! {
            _ = futures::future::join_all(sends) => {}
            _ = ctx.lifecycle.stopping() => return,
        }
        if busy {
            continue;
        }
        tokio::select! {
            _ = ctx.hooks.wake.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = ctx.lifecycle.stopping() => return,
        }
    }
}

async fn attempt(ctx: &ServiceContext, d: store::hooks::DueDelivery) {
    let opened = open_secret(
        ctx,
        d.hook_team_id,
        d.hook_id,
        &d.key_id,
        &d.nonce,
        &d.ciphertext,
    );
    let answer = match opened {
        Ok(secret) => {
            ctx.hooks
                .caller
                .send(&delivery::Request {
                    url: &d.url,
                    team_hook: d.hook_team_id.is_some(),
                    secret: secret.expose().as_bytes(),
                    event: &d.event,
                    delivery_id: &DeliveryId::from(d.id).to_string(),
                    body: &d.body,
                })
                .await
        }
        Err(why) => delivery::Answer {
            status: None,
            body: Vec::new(),
            error: Some(why),
            duration: Duration::ZERO,
        },
    };
    let ok = answer.ok();
    let (status, retry_in) = if ok {
        ("delivered", 0.0)
    } else if Utc::now() >= d.retry_until {
        ("failed", 0.0)
    } else {
        ("pending", delivery::backoff_s(d.attempts))
    };
    let error = (!ok).then(|| answer.why());
    let counted = if status == "pending" { "retry" } else { status };
    ctx.hooks.deliveries.with(&[counted]).inc();
    if !ok {
        tracing::info!(delivery_id = %DeliveryId::from(d.id), event = %d.event, attempts = d.attempts,
            status, error = error.as_deref().unwrap_or(""), "hook delivery attempt failed");
    }
    if let Err(e) = store::hooks::finish_attempt(
        ctx.data.pool.pool(),
        d.id,
        status,
        retry_in,
        answer.status.map(i32::from),
        error.as_deref(),
        answer.duration.as_millis().min(i32::MAX as u128) as i32,
    )
    .await
    {
        tracing::warn!(error = %e, "could not record a hook delivery attempt");
    }
}

// ---- waiting hooks -------------------------------------------------------------------

/// The largest environment a waiting hook may hand a launch.
fn check_env(env: &Value) -> Result<(), String> {
    let Some(m) = env.as_object() else {
        return Err("`env` must be an object of strings".into());
    };
    if m.len() > MAX_HOOK_ENV {
        return Err(format!("`env` has more than {MAX_HOOK_ENV} variables"));
    }
    for (k, v) in m {
        if !valid_env_name(k) {
            return Err(format!(
                "`env` name `{k}` is not an environment variable name (A-Z, 0-9, `_`)"
            ));
        }
        match v.as_str() {
            Some(s) if s.len() <= super::secrets::MAX_VALUE_BYTES && !s.contains('\0') => {}
            _ => {
                return Err(format!(
                    "`env` value of `{k}` must be a string of at most 32 KiB"
                ));
            }
        }
    }
    Ok(())
}

/// Launch environment from a request's `env` (already checked by `check_env`).
pub(crate) fn env_of(request: &Value) -> SecretEnv {
    request
        .get("env")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), SecretValue::new(v.as_str()?))))
                .collect()
        })
        .unwrap_or_default()
}

/// A body as recorded: the launch environment's values masked (it is never stored).
fn masked(body: &str) -> String {
    let Ok(mut v) = serde_json::from_str::<Value>(body) else {
        return body.to_owned();
    };
    if let Some(env) = v
        .pointer_mut("/payload/request/env")
        .and_then(Value::as_object_mut)
    {
        for value in env.values_mut() {
            *value = json!(crate::domain::secret::REDACTED);
        }
    }
    v.to_string()
}

/// How a waiting hook's answer is taken.
pub(crate) enum Answering<'a> {
    /// 200 `{"request": …}` replaces the request, after this check (previous, new); 204
    /// keeps it.
    Replace(&'a (dyn Fn(&Value, &Value) -> Result<Value, String> + Sync)),
    /// 200 or 204: nothing to change.
    Acknowledge,
}

/// Call the waiting hooks of `event` in order (server hooks, then the team's, each by
/// creation), each seeing the previous one's result, and return the final request. The
/// payload is `{payload_key: request}`. A failing hook fails the whole call with
/// `hook_failed` naming it.
#[tracing::instrument(name = "services::hooks::call_waiting", skip_all)]
pub(crate) async fn call_waiting(
    ctx: &ServiceContext,
    by: &Principal,
    event: HookEvent,
    subject: Subject<'_>,
    payload_key: &str,
    mut request: Value,
    answering: Answering<'_>,
) -> ServiceResult<Value> {
    let hooks = hooks_for(ctx, event, &subject).await?;
    for h in hooks {
        let hook = &h.hook;
        let failed = |why: String| {
            ServiceError::HookFailed(format!(
                "hook {} ({}) failed: {why}",
                hook.name,
                HookId::from(hook.id)
            ))
        };
        let secret = open_secret(
            ctx,
            hook.team_id,
            hook.id,
            &h.key_id,
            &h.nonce,
            &h.ciphertext,
        )
        .map_err(failed)?;
        let id = Uuid::now_v7();
        let mut payload = serde_json::Map::new();
        payload.insert(payload_key.to_owned(), request.clone());
        let body = body_of(id, event, subject.team, Value::Object(payload));
        let answer = ctx
            .hooks
            .caller
            .send(&delivery::Request {
                url: &hook.url,
                team_hook: hook.team_id.is_some(),
                secret: secret.expose().as_bytes(),
                event: event.as_str(),
                delivery_id: &DeliveryId::from(id).to_string(),
                body: &body,
            })
            .await;
        let outcome: Result<Option<Value>, String> = match (answer.error.as_ref(), answer.status) {
            (Some(e), _) => Err(e.clone()),
            (None, Some(204)) => Ok(None),
            (None, Some(200)) => {
                match &answering {
                    Answering::Acknowledge => Ok(None),
                    Answering::Replace(check) => {
                        match serde_json::from_slice::<Value>(&answer.body) {
                        Ok(Value::Object(mut m)) if m.contains_key("request") => {
                            let new = m.remove("request").unwrap_or_default();
                            check(&request, &new).map(Some)
                        }
                        _ => Err(
                            "answered 200 without a JSON object `{\"request\": …}` (answer 204 to keep the request)"
                                .into(),
                        ),
                    }
                    }
                }
            }
            (None, Some(s)) => Err(format!("the receiver answered {s} (expected 200 or 204)")),
            (None, None) => Err("no answer".into()),
        };
        let recorded = store::hooks::record_call(
            &ctx.data.pool,
            &store::hooks::CallRecord {
                id,
                hook_id: hook.id,
                hook_name: &hook.name,
                event: event.as_str(),
                team_id: Some(subject.team),
                body: &masked(&body),
                delivered: outcome.is_ok(),
                response_status: answer.status.map(i32::from),
                error: outcome.as_ref().err().map(String::as_str),
                duration_ms: answer.duration.as_millis().min(i32::MAX as u128) as i32,
            },
        )
        .await;
        if let Err(e) = recorded {
            tracing::warn!(error = %e, "could not record a waiting hook call");
        }
        ctx.hooks
            .deliveries
            .with(&[if outcome.is_ok() {
                "delivered"
            } else {
                "failed"
            }])
            .inc();
        match outcome {
            Ok(Some(new)) => request = new,
            Ok(None) => {}
            Err(why) => {
                tracing::info!(hook_id = %HookId::from(hook.id), event = event.as_str(), why = %why, "a waiting hook failed its operation");
                // The refusal is on record, with who asked for the operation.
                audit::record(
                    &ctx.data,
                    by,
                    Entry::new(
                        Action::HookFail,
                        Some(subject.team),
                        "hook",
                        HookId::from(hook.id),
                    )
                    .details(json!({"event": event.as_str(), "name": hook.name, "why": why})),
                )
                .await?;
                return Err(failed(why));
            }
        }
    }
    Ok(request)
}

/// The checks of `agent.create.before` and `agent.open.before` on `env`, shared.
pub(crate) fn checked_env(new: &Value) -> Result<(), String> {
    match new.get("env") {
        None | Some(Value::Null) => Ok(()),
        Some(env) => check_env(env),
    }
}

/// The fields of `new` other than `allowed` must equal those of `previous`.
pub(crate) fn only_changed(previous: &Value, new: &Value, allowed: &[&str]) -> Result<(), String> {
    let (Some(p), Some(n)) = (previous.as_object(), new.as_object()) else {
        return Err("`request` must be an object".into());
    };
    for key in p.keys().chain(n.keys()) {
        if allowed.contains(&key.as_str()) {
            continue;
        }
        if p.get(key) != n.get(key) {
            return Err(format!("`{key}` may not be changed by this hook"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_hook_ids_are_stable_per_name() {
        assert_eq!(settings_hook_id("a"), settings_hook_id("a"));
        assert_ne!(settings_hook_id("a"), settings_hook_id("b"));
        assert_eq!(settings_hook_id("a").get_version_num(), 8);
    }

    #[test]
    fn only_listed_fields_may_change() {
        let p = json!({"agent_id": "agt_1", "env": {}, "mcp_servers": {}});
        assert!(
            only_changed(
                &p,
                &json!({"agent_id": "agt_1", "env": {"A": "1"}, "mcp_servers": {}}),
                &["env", "mcp_servers"]
            )
            .is_ok()
        );
        assert!(
            only_changed(
                &p,
                &json!({"agent_id": "agt_2", "env": {}}),
                &["env", "mcp_servers"]
            )
            .is_err()
        );
    }

    #[test]
    fn env_is_checked() {
        assert!(check_env(&json!({"REGION": "eu"})).is_ok());
        assert!(check_env(&json!({"bad name": "x"})).is_err());
        assert!(check_env(&json!({"A": 1})).is_err());
        assert!(check_env(&json!(["A"])).is_err());
    }

    #[test]
    fn stored_bodies_mask_env() {
        let b = json!({"payload": {"request": {"env": {"TOKEN": "s3cret-value"}}}}).to_string();
        assert!(!masked(&b).contains("s3cret-value"));
    }
}
