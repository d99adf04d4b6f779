//! The lifecycle points a hook can be called at, with the names and the waiting rule of
//! the seed (`subject.operation.position`): a waiting hook is called synchronously and
//! may change or veto the operation; a notification is delivered afterwards from the
//! outbox and never delays anything.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum HookEvent {
    #[serde(rename = "workspace.create.before")]
    WorkspaceCreateBefore,
    #[serde(rename = "workspace.create.after")]
    WorkspaceCreateAfter,
    #[serde(rename = "workspace.archive.after")]
    WorkspaceArchiveAfter,
    #[serde(rename = "worktree.create.before")]
    WorktreeCreateBefore,
    #[serde(rename = "worktree.create.after")]
    WorktreeCreateAfter,
    #[serde(rename = "agent.create.before")]
    AgentCreateBefore,
    #[serde(rename = "agent.create.after")]
    AgentCreateAfter,
    #[serde(rename = "agent.open.before")]
    AgentOpenBefore,
    #[serde(rename = "agent.close.after")]
    AgentCloseAfter,
    #[serde(rename = "agent.archive.after")]
    AgentArchiveAfter,
    #[serde(rename = "agent.turn.before")]
    AgentTurnBefore,
    #[serde(rename = "agent.turn.after")]
    AgentTurnAfter,
    #[serde(rename = "agent.permission.before")]
    AgentPermissionBefore,
    #[serde(rename = "agent.permission.after")]
    AgentPermissionAfter,
    /// A team's budget reached 80 % or 100 % of its limit (a notification).
    #[serde(rename = "budget.threshold")]
    BudgetThreshold,
}

impl HookEvent {
    pub const ALL: [HookEvent; 15] = [
        HookEvent::WorkspaceCreateBefore,
        HookEvent::WorkspaceCreateAfter,
        HookEvent::WorkspaceArchiveAfter,
        HookEvent::WorktreeCreateBefore,
        HookEvent::WorktreeCreateAfter,
        HookEvent::AgentCreateBefore,
        HookEvent::AgentCreateAfter,
        HookEvent::AgentOpenBefore,
        HookEvent::AgentCloseAfter,
        HookEvent::AgentArchiveAfter,
        HookEvent::AgentTurnBefore,
        HookEvent::AgentTurnAfter,
        HookEvent::AgentPermissionBefore,
        HookEvent::AgentPermissionAfter,
        HookEvent::BudgetThreshold,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            HookEvent::WorkspaceCreateBefore => "workspace.create.before",
            HookEvent::WorkspaceCreateAfter => "workspace.create.after",
            HookEvent::WorkspaceArchiveAfter => "workspace.archive.after",
            HookEvent::WorktreeCreateBefore => "worktree.create.before",
            HookEvent::WorktreeCreateAfter => "worktree.create.after",
            HookEvent::AgentCreateBefore => "agent.create.before",
            HookEvent::AgentCreateAfter => "agent.create.after",
            HookEvent::AgentOpenBefore => "agent.open.before",
            HookEvent::AgentCloseAfter => "agent.close.after",
            HookEvent::AgentArchiveAfter => "agent.archive.after",
            HookEvent::AgentTurnBefore => "agent.turn.before",
            HookEvent::AgentTurnAfter => "agent.turn.after",
            HookEvent::AgentPermissionBefore => "agent.permission.before",
            HookEvent::AgentPermissionAfter => "agent.permission.after",
            HookEvent::BudgetThreshold => "budget.threshold",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        HookEvent::ALL.into_iter().find(|e| e.as_str() == s)
    }

    /// The operation waits for the answer (and may be changed or vetoed by it).
    pub fn waits(self) -> bool {
        matches!(
            self,
            HookEvent::WorkspaceCreateBefore
                | HookEvent::WorktreeCreateBefore
                | HookEvent::WorktreeCreateAfter
                | HookEvent::AgentCreateBefore
                | HookEvent::AgentOpenBefore
        )
    }
}

impl std::fmt::Display for HookEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_five_wait() {
        for e in HookEvent::ALL {
            assert_eq!(HookEvent::parse(e.as_str()), Some(e));
            assert_eq!(serde_json::to_value(e).unwrap(), e.as_str());
        }
        assert_eq!(HookEvent::ALL.iter().filter(|e| e.waits()).count(), 5);
        assert_eq!(HookEvent::parse("agent.turn.during"), None);
    }
}
