//! What a service operation can refuse or fail with. Each variant has a stable code
//! (`ServiceError::code`, the `code` clients see); the HTTP status for each is chosen at
//! the edge, in `api::error`, which is the only place that knows HTTP.

use crate::auth::AuthError;
use crate::events::WriteError;
use crate::git::GitError;
use crate::runtime::RuntimeError;

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// An id that does not exist, or that belongs to a team the caller cannot see.
    #[error("{0} not found")]
    NotFound(&'static str),
    /// A field of the request is not acceptable.
    #[error("{field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    /// A field inside the request (`mcp_servers.<name>.command`) is not acceptable.
    #[error("{field}: {message}")]
    InvalidAt { field: String, message: String },
    /// A bound of the settings (`[limits]`) would be exceeded.
    #[error("the limit `{limit}` ({value}) is reached")]
    LimitReached { limit: &'static str, value: u64 },
    #[error("the prompt is {size} bytes; the limit is {limit}")]
    PromptTooLarge { size: usize, limit: usize },
    #[error("unknown provider `{0}`")]
    UnknownProvider(String),
    /// The provider cannot be used for a new agent right now.
    #[error("provider `{provider}` is unavailable: {reason}")]
    ProviderUnavailable { provider: String, reason: String },
    /// An unattended mode was asked for an agent this server cannot sandbox.
    #[error(
        "mode `{mode}` runs unattended, and agents are not sandboxed on this server ({reason}); an admin may allow it with sandbox.allow_unconfined_unattended"
    )]
    SandboxUnavailable { mode: String, reason: String },
    /// The agent's team requires the sandbox, and agents are not sandboxed here.
    #[error(
        "the team requires its agents to run sandboxed, and agents are not sandboxed on this server ({reason})"
    )]
    SandboxRequired { reason: String },
    /// The provider could not be asked (e.g. for its models) right now.
    #[error("{0}")]
    ProviderUnreachable(String),
    #[error("{0}")]
    WorkspaceArchived(&'static str),
    #[error("the agent is archived")]
    AgentArchived,
    /// An agent's token creates agents only as deep as `limits.max_agent_depth`.
    #[error("an agent at depth {max} (limits.max_agent_depth) cannot create agents")]
    AgentDepthExceeded { max: i32 },
    /// The calling agent has `limits.max_children_per_agent` live children.
    #[error("this agent has {max} children that are not archived (limits.max_children_per_agent)")]
    AgentChildrenExceeded { max: i64 },
    /// The team has `limits.max_child_agents_per_team` live agents created by agents.
    #[error(
        "the team has {max} agents created by agents that are not archived (limits.max_child_agents_per_team)"
    )]
    TeamChildrenExceeded { max: i64 },
    /// An agent's token works only in its agent's project.
    #[error("an agent's token creates workspaces and agents only in its own project")]
    OutsideAgentProject,
    #[error("the team already has a project with this name")]
    ProjectNameTaken,
    /// The repository is already another team's live project.
    #[error("this repository is already a project of another team")]
    RepoInUse,
    /// The project's git remote could not be fetched.
    #[error("{0}")]
    RemoteUnavailable(String),
    #[error("archive the project's workspaces before deleting it")]
    ProjectHasWorkspaces,
    #[error("a team with this name already exists")]
    TeamNameTaken,
    /// The name belongs to a team of `[auth.oidc.groups]`.
    #[error("this team name is reserved for a team the identity provider's groups map to")]
    TeamNameReserved,
    #[error("a team keeps at least one owner: add another owner first")]
    LastOwner,
    #[error("a user with this email already exists")]
    UserEmailTaken,
    #[error("{0}")]
    WorkspacePathTaken(&'static str),
    #[error("branch `{0}` already exists")]
    BranchExists(String),
    #[error("the project's repository cannot be used: {0}")]
    RepositoryUnavailable(String),
    /// The project has no remote (or no forge) for what was asked.
    #[error("{0}")]
    NoRemote(&'static str),
    /// The remote branch is protected by `[projects] protected_branches`.
    #[error("branch `{0}` is protected (`projects.protected_branches`); push to another branch")]
    BranchProtected(String),
    /// The remote refused the push (without force: its branch has commits the workspace's
    /// lacks).
    #[error("the remote refused the push: {0}")]
    PushRejected(String),
    /// A pull request needs the workspace's branch on the remote first.
    #[error("push the workspace before opening a pull request")]
    NotPushed,
    /// The forge's REST API failed or refused.
    #[error("{0}")]
    ForgeFailed(String),
    #[error("the agent is closed; this request expired before it was answered")]
    PermissionExpired,
    /// A queued message that already left the queue (started, canceled or failed).
    #[error("the message is no longer queued (it is {0})")]
    MessageNotQueued(String),
    #[error("this Idempotency-Key was used with a different request body")]
    IdempotencyKeyReused,
    #[error("{0}")]
    IdempotencyKeyInProgress(&'static str),
    /// A waiting hook refused or failed: `hook <name> (<id>) failed: <why>`.
    #[error("{0}")]
    HookFailed(String),
    #[error("this hook comes from the settings file; change it there")]
    HookReadOnly,
    /// A trigger's webhook delivery is not signed (GitHub) or does not carry the token
    /// (GitLab) of the trigger's secret.
    #[error("{0}")]
    SignatureInvalid(&'static str),
    /// The store cannot be reached (or did not answer in time).
    #[error("the database is unavailable; retry later")]
    StoreUnavailable,
    /// The store is known to be down, for the reason given (`StoreHealth`).
    #[error("the database is unavailable: {0}; retry later")]
    StoreDown(String),
    /// The store is reachable but its schema is behind this server.
    #[error("database migrations are not applied")]
    NotReady,
    /// A budget of the team (or the agent) is out: no new work until it resets.
    #[error("{0}")]
    BudgetExhausted(Box<crate::runtime::Exhausted>),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Store(#[from] sqlx::Error),
    #[error(transparent)]
    Events(#[from] WriteError),
    #[error(transparent)]
    Git(#[from] GitError),
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

pub type ServiceResult<T> = Result<T, ServiceError>;

impl ServiceError {
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        ServiceError::Invalid {
            field,
            message: message.into(),
        }
    }

    /// The store could not be reached or did not answer: worth retrying once it is back.
    pub fn is_store_unavailable(&self) -> bool {
        match self {
            ServiceError::StoreUnavailable | ServiceError::StoreDown(_) => true,
            ServiceError::Store(e) => crate::store::health::is_unreachable(e),
            ServiceError::Events(WriteError::Unavailable) => true,
            _ => false,
        }
    }

    /// The stable code of this failure (`Store`, `Events`, `Runtime` and `Auth` carry the
    /// code of what they wrap, classified at the edge).
    pub fn code(&self) -> &'static str {
        match self {
            ServiceError::Auth(e) => e.code(),
            ServiceError::NotFound(_) => "not_found",
            ServiceError::Invalid { .. } | ServiceError::InvalidAt { .. } => "validation_failed",
            ServiceError::LimitReached { .. } => "limit_reached",
            ServiceError::PromptTooLarge { .. } => "prompt_too_large",
            ServiceError::UnknownProvider(_) => "unknown_provider",
            ServiceError::ProviderUnavailable { .. } | ServiceError::ProviderUnreachable(_) => {
                "provider_unavailable"
            }
            ServiceError::SandboxUnavailable { .. } => "sandbox_unavailable",
            ServiceError::SandboxRequired { .. } => "sandbox_required",
            ServiceError::WorkspaceArchived(_) => "workspace_archived",
            ServiceError::AgentArchived => "agent_archived",
            ServiceError::AgentDepthExceeded { .. } => "agent_depth_exceeded",
            ServiceError::AgentChildrenExceeded { .. } => "agent_children_exceeded",
            ServiceError::TeamChildrenExceeded { .. } => "team_children_exceeded",
            ServiceError::OutsideAgentProject => "outside_agent_project",
            ServiceError::ProjectNameTaken => "project_name_taken",
            ServiceError::ProjectHasWorkspaces => "project_has_workspaces",
            ServiceError::RepoInUse => "repo_in_use",
            ServiceError::RemoteUnavailable(_) => "remote_unavailable",
            ServiceError::TeamNameTaken => "team_name_taken",
            ServiceError::TeamNameReserved => "team_name_reserved",
            ServiceError::LastOwner => "last_owner",
            ServiceError::UserEmailTaken => "user_email_taken",
            ServiceError::WorkspacePathTaken(_) => "workspace_path_taken",
            ServiceError::BranchExists(_) => "branch_exists",
            ServiceError::RepositoryUnavailable(_) => "repository_unavailable",
            ServiceError::NoRemote(_) => "no_remote",
            ServiceError::BranchProtected(_) => "branch_protected",
            ServiceError::PushRejected(_) => "push_rejected",
            ServiceError::NotPushed => "not_pushed",
            ServiceError::ForgeFailed(_) => "forge_failed",
            ServiceError::PermissionExpired => "permission_expired",
            ServiceError::MessageNotQueued(_) => "message_not_queued",
            ServiceError::IdempotencyKeyReused => "idempotency_key_reused",
            ServiceError::IdempotencyKeyInProgress(_) => "idempotency_key_in_progress",
            ServiceError::HookFailed(_) => "hook_failed",
            ServiceError::HookReadOnly => "hook_read_only",
            ServiceError::SignatureInvalid(_) => "signature_invalid",
            ServiceError::StoreUnavailable | ServiceError::StoreDown(_) => "store_unavailable",
            ServiceError::NotReady => "not_ready",
            ServiceError::BudgetExhausted(_) => "budget_exhausted",
            ServiceError::Runtime(_) => "runtime",
            ServiceError::Store(_) => "store",
            ServiceError::Events(_) => "events",
            ServiceError::Git(_) | ServiceError::Unexpected(_) => "internal",
        }
    }
}
