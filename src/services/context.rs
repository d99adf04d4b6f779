//! What services need from the running server, in parts: each service function takes the
//! parts it uses (`&Data`, `&Access`, …), and the few that use most of them take the whole
//! `ServiceContext`. The parts are plain structs of shared handles, cheap to clone.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::runtime::Handle;
use tokio::sync::watch;

use super::{audit, bounds, hooks, network, queue, secrets, triggers, usage};
use crate::config::{Limits, ProjectSettings, WorkspaceSettings};
use crate::events::{Bus, EventWriter};
use crate::runtime::AgentManager;
use crate::store::DeadlinePool;

/// The store and the paths into it: the pool every query runs on, the event writer and
/// bus, and the audit log. Nearly every service uses it.
#[derive(Clone)]
pub struct Data {
    /// Every call on it ends within `[database] statement_deadline_ms`.
    pub pool: DeadlinePool,
    pub writer: EventWriter,
    pub bus: Arc<Bus>,
    /// Writes the entries of `audit::record`, in batches (on `pool`, within its deadline).
    pub audit: audit::AuditLog,
}

/// Who a caller is and what opens their secrets: token and session checks, and the key
/// that seals team secrets.
#[derive(Clone)]
pub struct Access {
    /// Principals of recently used API tokens; what changes one calls `forget_all`.
    pub tokens: Arc<crate::auth::TokenCache>,
    /// The OpenID Connect provider, when `[auth.oidc]` is configured.
    pub oidc: Option<crate::auth::oidc::Oidc>,
    /// Seals and opens team secrets.
    pub secrets: Arc<secrets::Keyring>,
    /// How often an open stream or wait checks its caller again at least
    /// (`events.revalidate_s`).
    pub revalidate: std::time::Duration,
}

/// The live agents and what bounds them: the runtime's agent manager, the limits and
/// per-principal bounds, and what agents are given at launch (egress, the `agentry` MCP).
#[derive(Clone)]
pub struct Fleet {
    pub agents: AgentManager,
    pub limits: Limits,
    /// Per-principal and per-team bounds, and the MCP servers of the settings.
    pub bounds: Arc<bounds::Bounds>,
    /// The server's part of agents' egress allow lists (`[egress]` over the built-in
    /// lists), for agents whose sandbox uses the egress proxy.
    pub egress_policy: Arc<network::EgressPolicy>,
    /// This server's `/mcp` as agents reach it (`agents.agentry_mcp_url`, or derived from
    /// the address it listens on): the URL of the `agentry` MCP server agents are given.
    pub agentry_mcp_url: Option<String>,
}

/// Where repositories come from and where their clones and worktrees live.
#[derive(Clone)]
pub struct Repositories {
    /// Where projects may come from and where clones live.
    pub projects: ProjectSettings,
    /// Bounds on repository setup and teardown commands.
    pub workspaces: WorkspaceSettings,
    /// Worktrees live under `<data_dir>/worktrees`.
    pub data_dir: PathBuf,
}

/// What spending and waiting are held to: usage prices and budgets, and the queue of
/// prompts that wait for a running-turn slot.
#[derive(Clone)]
pub struct Governance {
    /// The usage price table, owners' budget limits and usage metrics.
    pub usage: Arc<usage::UsageBook>,
    /// The dispatcher's wake-up for queued prompts.
    pub queue: Arc<queue::Queue>,
}

/// Where long-lived work runs and when it must end.
#[derive(Clone)]
pub struct Lifecycle {
    /// The main runtime: long-lived tasks go here, not on an HTTP worker's.
    pub runtime: Handle,
    /// Flips to true when the server stops, so long waits end.
    pub shutdown: watch::Receiver<bool>,
}

impl Lifecycle {
    /// Resolves once the server starts shutting down.
    pub async fn stopping(&self) {
        let mut rx = self.shutdown.clone();
        let _ = rx.wait_for(|s| *s).await;
    }
}

/// The composition root of the parts, built once when the server starts. Services that
/// use most of the parts (agents, workspaces, queue, hooks, triggers, CI, …) take it
/// whole; the others take only their parts.
#[derive(Clone)]
pub struct ServiceContext {
    pub data: Data,
    pub access: Access,
    pub fleet: Fleet,
    pub repos: Repositories,
    pub governance: Governance,
    pub lifecycle: Lifecycle,
    /// Lifecycle hooks: their HTTP clients and settings.
    pub hooks: Arc<hooks::Hooks>,
    /// Triggers' settings and the scheduler's clock.
    pub triggers: Arc<triggers::Triggers>,
}
