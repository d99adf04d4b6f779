//! The operations handlers call: validation, authorization, transactions and
//! idempotency, one module per aggregate. Live agent work is handed to the runtime.

pub mod agents;
pub mod idempotency;
pub mod projects;
pub mod tokens;
pub mod workspaces;

use crate::api::error::{ApiError, ApiResult};
use crate::events::NewTeamEvent;
use crate::server::AppState;

/// Put an event on the team activity stream (committed before this returns).
pub(crate) async fn announce(state: &AppState, event: NewTeamEvent) -> ApiResult<()> {
    state
        .writer
        .append_committed(Vec::new(), vec![event])
        .await
        .map(|_| ())
        .map_err(write_error)
}

/// An event write that failed: 503 while the store is unavailable.
pub(crate) fn write_error(e: crate::events::WriteError) -> ApiError {
    match e {
        crate::events::WriteError::Unavailable => ApiError::store_unavailable(),
        crate::events::WriteError::Stopped => ApiError::internal(e),
    }
}
