//! The operations handlers call, one module per aggregate: validation, authorization
//! (team roles and token scopes, from `auth`), transactions and idempotency. Every read
//! and write of the API goes through here, so scoping by the caller's teams lives in one
//! place. Services know no HTTP: they take a `ServiceContext`, plain values and a
//! `Principal`, and return their own types or a `ServiceError`. Live agent work is handed
//! to the runtime.

pub mod agents;
pub mod audit;
pub mod bounds;
pub mod ci;
pub mod cluster;
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

use std::path::PathBuf;
use std::sync::Arc;

use tokio::runtime::Handle;
use tokio::sync::watch;

pub use error::{ServiceError, ServiceResult};

use crate::config::{Limits, WorkspaceSettings};
use crate::events::{Bus, EventWriter, NewTeamEvent};
use crate::runtime::AgentManager;
use crate::store::DeadlinePool;

/// What services need from the running server, and nothing more.
#[derive(Clone)]
pub struct ServiceContext {
    /// Every call on it ends within `[database] statement_deadline_ms`.
    pub pool: DeadlinePool,
    pub writer: EventWriter,
    pub bus: Arc<Bus>,
    pub agents: AgentManager,
    /// The main runtime: long-lived tasks go here, not on an HTTP worker's.
    pub runtime: Handle,
    pub limits: Limits,
    /// Bounds on repository setup and teardown commands.
    pub workspaces: WorkspaceSettings,
    /// Where projects may come from and where clones live.
    pub projects: crate::config::ProjectSettings,
    /// Worktrees live under `<data_dir>/worktrees`.
    pub data_dir: PathBuf,
    /// Flips to true when the server stops, so long waits end.
    pub shutdown: watch::Receiver<bool>,
    /// Seals and opens team secrets.
    pub secrets: Arc<secrets::Keyring>,
    /// Lifecycle hooks: their HTTP clients and settings.
    pub hooks: Arc<hooks::Hooks>,
    /// The OpenID Connect provider, when `[auth.oidc]` is configured.
    pub oidc: Option<crate::auth::oidc::Oidc>,
    /// Writes the entries of `audit::record`, in batches.
    pub audit: audit::AuditLog,
    /// Principals of recently used API tokens; what changes one calls `forget_all`.
    pub tokens: Arc<crate::auth::TokenCache>,
    /// Per-principal and per-team bounds, and the MCP servers of the settings.
    pub bounds: Arc<bounds::Bounds>,
    /// The usage price table, owners' budget limits and usage metrics.
    pub usage: Arc<usage::UsageBook>,
    /// The dispatcher's wake-up for queued prompts.
    pub queue: Arc<queue::Queue>,
    /// Triggers' settings and the scheduler's clock.
    pub triggers: Arc<triggers::Triggers>,
    /// How often an open stream or wait checks its caller again at least
    /// (`events.revalidate_s`).
    pub revalidate: std::time::Duration,
    /// The server's part of agents' egress allow lists (`[egress]` over the built-in
    /// lists), for agents whose sandbox uses the egress proxy.
    pub egress_policy: Arc<network::EgressPolicy>,
    /// This server's `/mcp` as agents reach it (`agents.agentry_mcp_url`, or derived from
    /// the address it listens on): the URL of the `agentry` MCP server agents are given.
    pub agentry_mcp_url: Option<String>,
}

impl ServiceContext {
    /// Resolves once the server starts shutting down.
    pub async fn stopping(&self) {
        let mut rx = self.shutdown.clone();
        let _ = rx.wait_for(|s| *s).await;
    }
}

/// Run `work` (typically a transaction on `ctx.pool.pool()`) within the store's deadline,
/// so a stalled database fails it with `StoreUnavailable` instead of hanging the request.
pub(crate) async fn within_deadline<T>(
    ctx: &ServiceContext,
    work: impl std::future::Future<Output = ServiceResult<T>>,
) -> ServiceResult<T> {
    tokio::time::timeout(ctx.pool.deadline(), work)
        .await
        .map_err(|_| ServiceError::StoreUnavailable)?
}

/// Put an event on the team activity stream: committed before this returns, or, when the
/// store is slow to confirm, queued to commit in order.
pub(crate) async fn announce(ctx: &ServiceContext, event: NewTeamEvent) -> ServiceResult<()> {
    match ctx.writer.append_committed(Vec::new(), vec![event]).await {
        // Not confirmed in time, but queued: it commits in order once the store answers,
        // and what it announces is already done (a 503 now would invite a duplicate).
        Ok(_) | Err(crate::events::WriteError::Unavailable) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
