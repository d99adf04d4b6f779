//! The operations handlers call, one module per aggregate: validation, authorization
//! (team roles and token scopes, from `auth`), transactions and idempotency. Every read
//! and write of the API goes through here, so scoping by the caller's teams lives in one
//! place. Services know no HTTP: they take the parts of the `ServiceContext` they use (or
//! the whole of it), plain values and a `Principal`, and return their own types or a
//! `ServiceError`. Live agent work is handed to the runtime.

pub mod agents;
pub mod audit;
pub mod bounds;
pub mod ci;
pub mod cluster;
mod context;
pub mod device;
pub mod error;
pub mod health;
pub mod hooks;
pub mod idempotency;
pub mod identity;
pub mod mcp;
pub mod network;
pub mod projects;
pub mod providers;
pub mod queue;
pub mod secrets;
pub mod sessions;
pub mod setup;
pub mod streams;
pub mod teams;
pub mod triggers;
pub mod usage;
pub mod users;
pub mod workspaces;

pub use context::{Access, Data, Fleet, Governance, Lifecycle, Repositories, ServiceContext};
pub use error::{ServiceError, ServiceResult};

use crate::events::NewTeamEvent;

/// Run `work` (typically a transaction on `data.pool.pool()`) within the store's deadline,
/// so a stalled database fails it with `StoreUnavailable` instead of hanging the request.
pub(crate) async fn within_deadline<T>(
    data: &Data,
    work: impl std::future::Future<Output = ServiceResult<T>>,
) -> ServiceResult<T> {
    tokio::time::timeout(data.pool.deadline(), work)
        .await
        .map_err(|_| ServiceError::StoreUnavailable)?
}

/// Put an event on the team activity stream: committed before this returns, or, when the
/// store is slow to confirm, queued to commit in order.
pub(crate) async fn announce(data: &Data, event: NewTeamEvent) -> ServiceResult<()> {
    match data.writer.append_committed(Vec::new(), vec![event]).await {
        // Not confirmed in time, but queued: it commits in order once the store answers,
        // and what it announces is already done (a 503 now would invite a duplicate).
        Ok(_) | Err(crate::events::WriteError::Unavailable) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
