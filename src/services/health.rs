//! Readiness: the store is reachable and every migration this server knows is applied,
//! and the identity provider's keys are loaded when one is configured.

use super::{Access, Data, ServiceError, ServiceResult};
use crate::store;

#[tracing::instrument(name = "services::health::ready", skip_all)]
pub async fn ready(data: &Data, access: &Access) -> ServiceResult<()> {
    // Known down: say why at once, without waiting for a connection.
    if let Some(reason) = data.pool.health().reason() {
        return Err(ServiceError::StoreDown(reason));
    }
    let latest = store::MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    match store::applied_migration(&data.pool).await {
        Ok(Some(v)) if v >= latest => match &access.oidc {
            Some(idp) if !idp.is_ready() => Err(ServiceError::NotReady),
            _ => Ok(()),
        },
        Ok(_) => Err(ServiceError::NotReady),
        Err(e) => {
            tracing::warn!(error = %e, "readiness: the store is unreachable");
            match data.pool.health().reason() {
                Some(reason) => Err(ServiceError::StoreDown(reason)),
                None => Err(ServiceError::StoreUnavailable),
            }
        }
    }
}

/// What `GET /metrics` reads from the store: agents (not archived) by provider and status.
#[tracing::instrument(name = "services::health::agent_counts", skip_all)]
pub async fn agent_counts(data: &Data) -> ServiceResult<Vec<(String, String, i64)>> {
    Ok(store::agents::count_by_provider_and_status(&data.pool).await?)
}
