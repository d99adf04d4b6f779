//! Plain domain types with no I/O, shared by every layer: typed ids, the agent event
//! envelope and its kinds, statuses and outcomes, the lifecycle points of hooks, and the redacting wrapper of secrets.

pub mod event;
pub mod hook;
pub mod ids;
pub mod net;
pub mod secret;

pub use event::*;
pub use hook::HookEvent;
pub use ids::*;
pub use secret::{REDACTED, Redactor, SecretEnv, SecretValue};
