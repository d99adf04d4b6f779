//! What every built-in adapter takes of the provider framework, imported whole
//! (`use super::adapter::*`): the trait it implements, what it is handed and what it
//! reports, and the pieces of a session's life every adapter has.

pub use super::emitter::{Emitter, StopSignals, Stopper};
pub use super::{
    Ask, Availability, Builtin, CliConfig, EventSink, Launcher, ModeInfo, ModeRow, ModelInfo,
    PermissionDecision, PermissionRequest, Probe, ProcessLauncher, Provider, ProviderError,
    ProviderEvent, ProviderInfo, ProviderSession, SessionInfo, SessionSpec, Started, TurnInput,
    command_missing, mode,
};
