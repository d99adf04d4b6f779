//! The mock agent.
