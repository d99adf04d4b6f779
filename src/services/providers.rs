//! Providers: which agent CLIs this server can run, whether they are usable now by the
//! caller's team (a provider that takes team secrets needs the team to have set them),
//! their modes and models.

use serde::Serialize;
use utoipa::ToSchema;

use super::{ServiceContext, ServiceError, ServiceResult};
use crate::auth::{Operation, Principal};
use crate::config::{SandboxMode, SandboxNetwork};
use crate::domain::{TeamId, WorkspaceId};
use crate::providers::{Availability, CatalogScope, ModeInfo, ModelInfo, ProviderCapabilities};

#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"id": "mock", "label": "Mock agent", "protocol": "acp", "available": true,
    "unavailable_reason": null, "capabilities": {"resume": true, "set_mode": true, "set_model": true,
    "permissions": true, "mcp_servers": true},
    "modes": [{"id": "default", "label": "Default", "description": null, "unattended": false},
              {"id": "unattended", "label": "Unattended", "description": null, "unattended": true}],
    "default_mode": "default", "team_secrets": [], "sandbox": "enforced", "credentials": "inside",
    "credential_reason": "the mock provider calls no model API"}))]
pub struct ProviderView {
    pub id: String,
    pub label: String,
    pub protocol: String,
    pub available: bool,
    pub unavailable_reason: Option<String>,
    pub capabilities: ProviderCapabilities,
    pub modes: Vec<ModeInfo>,
    pub default_mode: Option<String>,
    /// The team secrets this provider takes (names only); it is available to a team
    /// only once the team has set each of them.
    pub team_secrets: Vec<String>,
    /// Whether this provider's agents run sandboxed here: `enforced`, `off` (`[sandbox]
    /// mode = "off"`) or `unavailable` (the host cannot sandbox).
    pub sandbox: SandboxState,
    /// Where the provider's model API key is for the caller's team: `brokered` (the
    /// egress proxy adds it on the way out; the CLI inside the sandbox has a placeholder)
    /// or `inside` (the CLI has it, in its environment or its files).
    pub credentials: CredentialPlace,
    /// Why the key is `inside` (null when brokered).
    pub credential_reason: Option<String>,
}

/// Whether a provider's agents run sandboxed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// Confined by the sandbox.
    Enforced,
    /// `[sandbox] mode = "off"`.
    Off,
    /// The sandbox is on but the host cannot sandbox (or the server has no sandbox layer).
    Unavailable,
}

/// Where a provider's model API key is while its agents run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CredentialPlace {
    /// Outside the sandbox: the egress proxy adds it to each model API request.
    Brokered,
    /// Inside the sandbox, with the CLI.
    Inside,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ProviderList {
    pub items: Vec<ProviderView>,
    /// Whether agent processes run sandboxed here: the mode, whether the host can, why
    /// not, and the network mode. Absent on a server started without the sandbox layer.
    pub sandbox: Option<crate::sandbox::SandboxStatus>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    pub items: Vec<ModelInfo>,
}

/// The providers, with their availability for `team` (default: the caller's team).
#[tracing::instrument(name = "services::providers::list", skip_all, fields(team_id = ?team))]
pub async fn list(
    ctx: &ServiceContext,
    principal: &Principal,
    team: Option<TeamId>,
) -> ServiceResult<ProviderList> {
    principal.authorize(Operation::ReadSelf)?;
    let team = match team {
        Some(t) => {
            principal.authorize_in(t.uuid(), Operation::ReadTeam, "team")?;
            Some(t.uuid())
        }
        None => principal.default_team(),
    };
    let registry = ctx.fleet.agents.registry();
    // Every secret any provider takes, opened once.
    let mut wanted: Vec<String> = registry
        .all()
        .flat_map(|p| registry.team_secrets(&p.info().id).to_vec())
        .collect();
    wanted.sort();
    wanted.dedup();
    let opened = match team {
        Some(team) => super::secrets::open_many(&ctx.data, &ctx.access, team, &wanted).await?,
        None => Default::default(),
    };
    // Keys are added outside only where the egress proxy stands between agents and the
    // network.
    let not_brokered =
        (!ctx.fleet.agents.uses_egress()).then(|| match ctx.fleet.agents.sandbox() {
            Some(s) if s.status().confines() => format!(
                "the sandbox's network is `{}`: only `proxy` puts agentry's egress proxy, which \
             adds keys, between the CLI and its model API",
                network_name(s.status().network)
            ),
            _ => "agents are not sandboxed here, so nothing stands between the CLI and its \
              model API"
                .to_owned(),
        });
    // The same sandbox confines every provider's agents.
    let sandbox = match ctx.fleet.agents.sandbox().map(|s| s.status()) {
        Some(s) if s.mode == SandboxMode::Off => SandboxState::Off,
        Some(s) if s.confines() => SandboxState::Enforced,
        _ => SandboxState::Unavailable,
    };
    let mut items = Vec::new();
    for p in registry.all() {
        let info = p.info();
        let team_secrets = registry.team_secrets(&info.id).to_vec();
        let secret_env = super::secrets::env_of(&team_secrets, &opened).unwrap_or_default();
        let (credentials, credential_reason) = match &not_brokered {
            Some(why) => (CredentialPlace::Inside, Some(why.clone())),
            None => match registry.brokering(&info.id, &secret_env) {
                Ok(_) => (CredentialPlace::Brokered, None),
                Err(why) => (CredentialPlace::Inside, Some(why)),
            },
        };
        let availability = match p.availability().await {
            Availability::Available => match super::secrets::env_of(&team_secrets, &opened) {
                Ok(_) => Availability::Available,
                Err(reason) => Availability::Unavailable(reason),
            },
            unavailable => unavailable,
        };
        let (available, unavailable_reason) = match availability {
            Availability::Available => (true, None),
            Availability::Unavailable(r) => (false, Some(r)),
        };
        items.push(ProviderView {
            id: info.id,
            label: info.label,
            protocol: info.protocol,
            available,
            unavailable_reason,
            capabilities: info.capabilities,
            modes: info.modes,
            default_mode: info.default_mode,
            team_secrets,
            sandbox,
            credentials,
            credential_reason,
        });
    }
    Ok(ProviderList {
        items,
        sandbox: ctx.fleet.agents.sandbox().map(|s| s.status().clone()),
    })
}

fn network_name(n: SandboxNetwork) -> &'static str {
    match n {
        SandboxNetwork::Host => "host",
        SandboxNetwork::None => "none",
        SandboxNetwork::Proxy => "proxy",
    }
}

#[tracing::instrument(name = "services::providers::models", skip_all, fields(workspace_id = ?workspace))]
pub async fn models(
    ctx: &ServiceContext,
    principal: &Principal,
    id: &str,
    workspace: Option<WorkspaceId>,
    refresh: bool,
) -> ServiceResult<ModelList> {
    principal.authorize(Operation::ReadSelf)?;
    // A workspace scope names a workspace: one the caller cannot see is missing.
    let scope = match workspace {
        None => CatalogScope::Global,
        Some(w) => {
            let ws = super::workspaces::find(&ctx.data, principal, w).await?;
            if ws.archived_at.is_some() {
                return Err(ServiceError::WorkspaceArchived(
                    "the workspace is archived; its files are gone",
                ));
            }
            CatalogScope::Workspace(ws.path.into())
        }
    };
    // A provider that cannot run (its CLI is not installed, no credentials) has no
    // catalog to probe: say why, as creating an agent on it does.
    let provider = ctx
        .fleet
        .agents
        .registry()
        .get(id)
        .ok_or(ServiceError::NotFound("provider"))?;
    if let Availability::Unavailable(reason) = provider.availability().await {
        return Err(ServiceError::ProviderUnavailable {
            provider: id.to_owned(),
            reason,
        });
    }
    // Nor has a provider the caller's team has not set its secrets for (as in `list`).
    let names = ctx.fleet.agents.registry().team_secrets(id);
    if !names.is_empty() {
        let opened = match principal.default_team() {
            Some(team) => super::secrets::open_many(&ctx.data, &ctx.access, team, names).await?,
            None => Default::default(),
        };
        if let Err(reason) = super::secrets::env_of(names, &opened) {
            return Err(ServiceError::ProviderUnavailable {
                provider: id.to_owned(),
                reason,
            });
        }
    }
    // A refresh starts the provider's CLI: each team (a caller without one: its token)
    // gets `limits.catalog_refreshes_per_minute` of them; past it the cached catalog is
    // answered, as without `refresh`.
    let refresh = refresh
        && ctx.fleet.bounds.refresh_allowed(
            principal
                .default_team()
                .unwrap_or_else(|| super::bounds::principal_key(principal)),
        );
    let items = ctx
        .fleet
        .agents
        .models(id, &scope, refresh)
        .await
        .ok_or(ServiceError::NotFound("provider"))?
        .map_err(ServiceError::ProviderUnreachable)?;
    Ok(ModelList {
        items: items.to_vec(),
    })
}
