//! What the adapters' unit tests share: reading a recorded transcript and picking out of
//! what its mapping made the events of each kind.

use std::sync::Mutex;

use async_trait::async_trait;
use serde_json::Value;

use super::{ProcessLauncher, ProviderEvent, ToolCallUpdate, Usage};
use crate::domain::{Behavior, PermissionOption, TurnOutcome};
use crate::process::{CommandSpec, ManagedChild, ProcessError, lock};

/// One of the things an adapter's mapping makes: an event, or something else only that
/// adapter acts on (a request to answer, a control response, …).
pub trait Mapped {
    fn event(&self) -> Option<&ProviderEvent>;
}

/// `Mapped` for an adapter's mapping output whose `Event` variant carries the events.
macro_rules! events_in_event_variant {
    ($output:ty) => {
        impl $crate::providers::test_support::Mapped for $output {
            fn event(&self) -> Option<&$crate::providers::ProviderEvent> {
                match self {
                    Self::Event(e) => Some(e),
                    _ => None,
                }
            }
        }
    };
}
pub(crate) use events_in_event_variant;

/// What `map` makes of each JSON message of `transcript`, in order.
pub fn replay_with<A>(transcript: &str, map: impl FnMut(&Value) -> Vec<A>) -> Vec<A> {
    json_lines(transcript).iter().flat_map(map).collect()
}

/// The JSON messages of a transcript, one a line; blank lines are passed over.
pub fn json_lines(transcript: &str) -> Vec<Value> {
    transcript
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("each recorded line is JSON"))
        .collect()
}

pub fn events<M: Mapped>(mapped: &[M]) -> Vec<&ProviderEvent> {
    mapped.iter().filter_map(M::event).collect()
}

pub fn tool_calls<M: Mapped>(mapped: &[M]) -> Vec<&ToolCallUpdate> {
    events(mapped)
        .into_iter()
        .filter_map(|e| match e {
            ProviderEvent::ToolCall(call) => Some(call),
            _ => None,
        })
        .collect()
}

/// The assistant text that streamed, joined.
pub fn deltas<M: Mapped>(mapped: &[M]) -> String {
    events(mapped)
        .into_iter()
        .filter_map(|e| match e {
            ProviderEvent::AssistantDelta { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

pub fn turn_ends<M: Mapped>(mapped: &[M]) -> Vec<(TurnOutcome, Option<String>, Option<Usage>)> {
    events(mapped)
        .into_iter()
        .filter_map(|e| match e {
            ProviderEvent::TurnEnded {
                outcome,
                error,
                usage,
            } => Some((*outcome, error.clone(), usage.clone())),
            _ => None,
        })
        .collect()
}

/// The one turn end of a transcript of one turn.
pub fn turn_end<M: Mapped>(mapped: &[M]) -> (TurnOutcome, Option<String>, Option<Usage>) {
    let mut ends = turn_ends(mapped);
    assert_eq!(ends.len(), 1, "exactly one turn end: {ends:?}");
    ends.remove(0)
}

/// Starts processes directly (no ledger) and remembers their pids.
#[derive(Default)]
pub struct Direct(Mutex<Vec<u32>>);

impl Direct {
    /// The pids of what it started, in order.
    pub fn pids(&self) -> Vec<u32> {
        lock(&self.0).clone()
    }
}

#[async_trait]
impl ProcessLauncher for Direct {
    async fn launch(&self, spec: CommandSpec) -> Result<ManagedChild, ProcessError> {
        let child = crate::process::spawn(&spec)?;
        lock(&self.0).push(child.pid());
        Ok(child)
    }
}

/// Process `pid` exists and has not exited (a zombie has).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

/// The options a person is offered, as they must be when the CLI offers to remember an
/// approval: allow, allow always, deny.
pub fn assert_allow_always_deny(options: &[PermissionOption]) {
    let got: Vec<(&str, Behavior)> = options
        .iter()
        .map(|o| (o.id.as_str(), o.behavior))
        .collect();
    assert_eq!(
        got,
        [
            ("allow", Behavior::Allow),
            ("allow_always", Behavior::Allow),
            ("deny", Behavior::Deny)
        ]
    );
}
