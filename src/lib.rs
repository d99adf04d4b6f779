//! agentry: a team server that runs AI coding agents in git worktrees, keeps every event
//! they produce in PostgreSQL and streams it live over Server-Sent Events.

pub mod api;
pub mod auth;
pub mod bench;
pub mod cli;
pub mod client;
pub mod config;
pub mod domain;
pub mod egress;
pub mod embedded_pg;
pub mod event_stream;
pub mod events;
pub mod forge;
pub mod git;
pub mod metrics;
pub mod process;
pub mod providers;
pub mod runtime;
pub mod sandbox;
pub mod server;
pub mod services;
pub mod store;
pub mod telemetry;
