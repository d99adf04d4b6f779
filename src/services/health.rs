//! Readiness: the store is reachable and every migration this server knows is applied.

use super::{ServiceContext, ServiceError, ServiceResult};
use crate::store;

pub async fn ready(ctx: &ServiceContext) -> ServiceResult<()> {
    let latest = store::MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    match store::applied_migration(&ctx.pool).await {
        Ok(Some(v)) if v >= latest => Ok(()),
        Ok(_) => Err(ServiceError::NotReady),
        Err(e) => {
            tracing::warn!(error = %e, "readiness: the store is unreachable");
            Err(ServiceError::StoreUnavailable)
        }
    }
}
