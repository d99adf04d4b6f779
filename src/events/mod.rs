//! The event pipeline: the `EventWriter` gives events their per-agent `seq`, commits them
//! to Postgres in batches and only then publishes them on the in-process `Bus`, from which
//! SSE connections read. Durable before visible, always.

mod bus;
mod fanout;
mod fault;
mod scrub;
mod writer;

pub use bus::{Bus, Published, TeamActivity};
pub use fanout::{Fanout, Notice, listen as listen_to_replicas, resync_streams};
pub use fault::{Fault, classify, is_unavailable};
pub use scrub::{REPLACEMENT, scrub};
pub use writer::{
    Attached, EventWriter, Fence, NewMoment, NewTeamEvent, StateChange, WriteError, WriterLimits,
    WriterStats,
};
