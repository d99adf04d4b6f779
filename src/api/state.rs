//! The state every request handler reads. It belongs to the HTTP layer, which the
//! server's wiring builds and serves: the dependency runs one way, server → api.

use crate::config::Settings;
use crate::egress::Egress;
use crate::services::ServiceContext;

/// Shared by every request handler: the services' context, plus what only the HTTP layer
/// reads (the settings of streams and bodies).
pub struct AppState {
    pub services: ServiceContext,
    pub settings: Settings,
    /// Requests counted for `GET /metrics`.
    pub http: super::metrics::HttpMetrics,
    /// The MCP sessions opened on this replica (`/mcp`).
    pub mcp: super::mcp::Sessions,
    /// The egress proxy: one endpoint per agent that runs in the proxy network mode.
    pub egress: Egress,
}
