//! Providers: which agent CLIs this server can run, whether they are usable now, their
//! modes and models.

use serde::Serialize;
use utoipa::ToSchema;

use super::{ServiceContext, ServiceError, ServiceResult};
use crate::auth::{Operation, Principal};
use crate::providers::{Availability, ModeInfo, ModelInfo, ProviderCapabilities};

#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"id": "mock", "label": "Mock agent", "protocol": "acp", "available": true,
    "unavailable_reason": null, "capabilities": {"resume": true, "set_mode": true, "set_model": true,
    "permissions": true, "mcp_servers": true},
    "modes": [{"id": "default", "label": "Default", "description": null, "unattended": false},
              {"id": "unattended", "label": "Unattended", "description": null, "unattended": true}],
    "default_mode": "default"}))]
pub struct ProviderView {
    pub id: String,
    pub label: String,
    pub protocol: String,
    pub available: bool,
    pub unavailable_reason: Option<String>,
    pub capabilities: ProviderCapabilities,
    pub modes: Vec<ModeInfo>,
    pub default_mode: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ProviderList {
    pub items: Vec<ProviderView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    pub items: Vec<ModelInfo>,
}

pub async fn list(ctx: &ServiceContext, principal: &Principal) -> ServiceResult<ProviderList> {
    principal.authorize(Operation::ReadSelf)?;
    let mut items = Vec::new();
    for p in ctx.agents.registry().all() {
        let info = p.info();
        let (available, unavailable_reason) = match p.availability().await {
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
        });
    }
    Ok(ProviderList { items })
}

pub async fn models(
    ctx: &ServiceContext,
    principal: &Principal,
    id: &str,
    refresh: bool,
) -> ServiceResult<ModelList> {
    principal.authorize(Operation::ReadSelf)?;
    // A provider that cannot run (its CLI is not installed, no credentials) has no
    // catalog to probe: say why, as creating an agent on it does.
    let provider = ctx
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
    let items = ctx
        .agents
        .models(id, refresh)
        .await
        .ok_or(ServiceError::NotFound("provider"))?
        .map_err(|e| ServiceError::ProviderUnreachable(e.to_string()))?;
    Ok(ModelList {
        items: items.to_vec(),
    })
}
