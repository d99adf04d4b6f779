//! API tests: each test gets a fresh database on a throwaway PostgreSQL cluster and a real
//! server on a random port, and talks to it over HTTP like a client would.

mod access_matrix;
mod agents;
mod attack_bounds;
mod attack_egress;
mod attack_git;
mod attack_identity;
mod attack_limits;
mod attack_projects;
mod attack_sandbox;
mod attack_tokens;
mod budgets;
mod ci_docs;
mod cli;
mod cluster;
mod device;
mod helpers;
mod hooks;
mod idempotency_claims;
mod input;
mod mcp;
mod metrics;
mod people;
mod platform;
mod runtime;
mod scopes;
mod secrets;
mod setup_scripts;
mod single_server;
mod story;
mod streams;
mod teams;
mod token_cache;
mod usage;
mod workspaces;
mod writer;
