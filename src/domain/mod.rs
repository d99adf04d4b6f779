//! Plain domain types with no I/O, shared by every layer: typed ids, the agent event
//! envelope and its kinds, statuses and outcomes.

pub mod event;
pub mod ids;

pub use event::*;
pub use ids::*;
