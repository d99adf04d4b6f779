//! The operations handlers call: validation, authorization, transactions and
//! idempotency, one module per aggregate. Live agent work is handed to the runtime.

pub mod agents;
pub mod idempotency;
pub mod projects;
pub mod tokens;
pub mod workspaces;
