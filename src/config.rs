//! Settings: built-in defaults, overlaid by an optional TOML file (`--config` /
//! `AGENTRY_CONFIG`), overlaid by `AGENTRY_*` environment variables and `DATABASE_URL`.
//! Validated once at start; errors name the setting. A setting the server does not
//! implement is refused, never ignored. Secrets are wrapped so `Debug` never shows them.
//!
//! Environment spelling: `__` separates nested keys (`AGENTRY_DATABASE__URL`) and key
//! names are matched case-insensitively, except where a key is data rather than a name:
//! - a provider id is lowercased and `_` spells `-` (ids never contain `_`):
//!   `AGENTRY_PROVIDERS__MY_AGENT__LABEL` sets `providers.my-agent.label`;
//! - a provider's `env` map keeps the variable name exactly as written, `__` included:
//!   `AGENTRY_PROVIDERS__MY_AGENT__ENV__ANTHROPIC_BASE_URL` sets `ANTHROPIC_BASE_URL`.
//!
//! Values are taken verbatim as text (`"8080"` stays the string `8080` for a label or an
//! `env` value), except for the settings that are numbers, booleans or lists (see
//! `typed_setting`), whose value is read as TOML: `20`, `false`, `["my-agent", "--acp"]`.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A secret value: shown as `[redacted]` in `Debug` and logs.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// Address the HTTP server listens on.
    pub listen: String,
    /// Where agentry keeps its state: worktrees, the embedded database, the admin token.
    pub data_dir: PathBuf,
    /// Older spelling of `cluster.replica_id` (both at once is refused).
    pub replica_id: Option<String>,
    /// `[cluster]`: several replicas on one database.
    pub cluster: ClusterSettings,
    pub database: DatabaseSettings,
    pub auth: AuthSettings,
    pub log: LogSettings,
    pub limits: Limits,
    pub events: EventSettings,
    pub agents: AgentSettings,
    pub workspaces: WorkspaceSettings,
    pub metrics: MetricsSettings,
    /// One table per provider id.
    pub providers: BTreeMap<String, ProviderSettings>,
    /// The key that encrypts team secrets at rest.
    pub secrets: SecretsSettings,
    /// Lifecycle hooks: delivery settings and server-wide hooks.
    pub hooks: HookSettings,
    /// `[server]`: how the HTTP server sees its clients.
    pub server: ServerSettings,
    /// `[mcp]`: the stdio MCP servers agents may use, and the rule for remote ones.
    pub mcp: McpSettings,
    /// `[projects]`: where project repositories may come from and where clones live.
    pub projects: ProjectSettings,
    /// `[egress]`: what agents may reach through the egress proxy.
    pub egress: EgressSettings,
    /// `[sandbox]`: how agent processes are confined.
    pub sandbox: SandboxSettings,
    /// `[usage]`: the price table of estimated costs and the limits of team budgets.
    pub usage: UsageSettings,
    /// `[triggers]`: webhook deliveries and schedules that start or continue agents.
    pub triggers: TriggerSettings,
    /// The settings file this was read from (not a setting): kept out of every sandbox.
    #[serde(skip)]
    pub config_file: Option<PathBuf>,
    /// The `agentry` executable (not a setting): its `sandbox-bridge` command, or the
    /// `agentry-sandbox` installed beside it, runs first in a sandbox of the `proxy`
    /// network mode, and that `agentry-sandbox` launches children that need setup before
    /// exec. `None`: the running executable, which is `agentry` itself when it serves; a
    /// program that embeds the server (the integration tests) names the `agentry` binary
    /// here.
    #[serde(skip)]
    pub bridge_program: Option<PathBuf>,
}

/// `[triggers]`: how webhook deliveries are received and schedules are kept.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TriggerSettings {
    /// The largest webhook delivery accepted, in bytes (default 1 MiB; GitHub sends at
    /// most 25 MB, but the events triggers act on are far smaller).
    pub max_body_bytes: usize,
    /// A schedule slot found more than this many seconds after its time counts as missed
    /// (every replica was down then): it runs once or is skipped by the trigger's
    /// `missed` (default 60).
    pub missed_after_s: u64,
    /// A worker holds a run it acts on for this many seconds at a time and renews the
    /// hold while it acts; a run whose worker died is taken by another after this
    /// (default 60).
    pub run_lease_s: u64,
    /// How many runs one replica's worker acts on at once (default 4).
    pub max_concurrent_runs: usize,
    /// Every this many seconds the state and checks of the open pull/merge requests that
    /// workspaces opened are read again from their forge, for those not read for as long
    /// (default 300; 0 turns the poll off: only deliveries and reads update them).
    pub pr_poll_s: u64,
    /// The most pull/merge requests one replica reads per poll (default 20).
    pub pr_poll_batch: u32,
    /// For tests only: the scheduler's clock stands still at this time and moves only
    /// when the test moves it. Never set it in a deployment: schedules would stop.
    pub manual_clock_start: Option<chrono::DateTime<chrono::Utc>>,
}

impl Default for TriggerSettings {
    fn default() -> Self {
        Self {
            max_body_bytes: 1024 * 1024,
            missed_after_s: 60,
            run_lease_s: 60,
            max_concurrent_runs: 4,
            pr_poll_s: 300,
            pr_poll_batch: 20,
            manual_clock_start: None,
        }
    }
}

impl TriggerSettings {
    fn validate(&self) -> Result<(), SettingsError> {
        if !(1024..=25 * 1024 * 1024).contains(&self.max_body_bytes) {
            return Err(invalid(
                "triggers.max_body_bytes",
                "must be between 1024 and 26214400 bytes",
            ));
        }
        if !(1..=86_400).contains(&self.missed_after_s) {
            return Err(invalid(
                "triggers.missed_after_s",
                "must be between 1 and 86400 seconds",
            ));
        }
        if !(3..=3600).contains(&self.run_lease_s) {
            return Err(invalid(
                "triggers.run_lease_s",
                "must be between 3 and 3600 seconds",
            ));
        }
        if !(1..=64).contains(&self.max_concurrent_runs) {
            return Err(invalid(
                "triggers.max_concurrent_runs",
                "must be between 1 and 64",
            ));
        }
        if self.pr_poll_s > 86_400 {
            return Err(invalid(
                "triggers.pr_poll_s",
                "must be between 1 and 86400 seconds, or 0 to turn the poll off",
            ));
        }
        if !(1..=1000).contains(&self.pr_poll_batch) {
            return Err(invalid(
                "triggers.pr_poll_batch",
                "must be between 1 and 1000",
            ));
        }
        Ok(())
    }
}

/// `[usage]`: what a turn costs when its CLI does not say, and how far team owners may
/// set their team's budget.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UsageSettings {
    /// Record each turn's usage in the ledger and hold budgets (default). `false` turns
    /// both off: no ledger rows, no budget or cap is enforced, and setting one is refused.
    pub ledger: bool,
    /// The most a team owner may set as the team's monthly cost budget, in USD (admins
    /// may set any; default: no maximum).
    pub max_team_cost_usd: Option<f64>,
    /// The most a team owner may set as the team's monthly token budget.
    pub max_team_tokens: Option<u64>,
    /// `[usage.prices.<provider>.<model>]`: USD per million tokens; the model `*` prices
    /// every model of the provider without a table of its own.
    pub prices: BTreeMap<String, BTreeMap<String, Price>>,
}

/// A model's prices, in USD per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
    /// Cached input tokens (a part of the input); default: the input price.
    pub cached_per_mtok: Option<f64>,
}

impl Default for UsageSettings {
    fn default() -> Self {
        Self {
            ledger: true,
            max_team_cost_usd: None,
            max_team_tokens: None,
            prices: BTreeMap::new(),
        }
    }
}

impl UsageSettings {
    fn validate(&self) -> Result<(), SettingsError> {
        if let Some(v) = self.max_team_cost_usd
            && !(v.is_finite() && v >= 0.0)
        {
            return Err(invalid(
                "usage.max_team_cost_usd",
                "must be a number of USD, 0 or more",
            ));
        }
        for (provider, models) in &self.prices {
            for (model, price) in models {
                let fields = [
                    ("input_per_mtok", Some(price.input_per_mtok)),
                    ("output_per_mtok", Some(price.output_per_mtok)),
                    ("cached_per_mtok", price.cached_per_mtok),
                ];
                for (field, value) in fields {
                    if let Some(v) = value
                        && !(v.is_finite() && v >= 0.0)
                    {
                        return Err(invalid(
                            &format!("usage.prices.{provider}.{model}.{field}"),
                            "must be a price in USD per million tokens, 0 or more",
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The price of `model` of `provider`: its own table, else the provider's `*`.
    pub fn price(&self, provider: &str, model: Option<&str>) -> Option<Price> {
        let models = self.prices.get(provider)?;
        model
            .and_then(|m| models.get(m))
            .or_else(|| models.get("*"))
            .copied()
    }
}

/// `[egress]`: the allow lists of the egress proxy (each entry `host`, `*.suffix`, `*` or
/// an IP literal, with an optional `:port`; checked when the server starts) and its
/// bounds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EgressSettings {
    /// Entries every agent may reach, beside its provider's and its team's (default none).
    pub allow: Vec<String>,
    /// `[egress.providers.<id>]`: a list that replaces the provider's built-in one.
    pub providers: BTreeMap<String, EgressProviderSettings>,
    /// Connections one agent may hold open through the proxy at once (default 64).
    pub max_connections_per_agent: usize,
    /// Seconds a proxied connection may stay silent both ways before it is closed
    /// (default 600: a model may think that long between streamed events).
    pub idle_timeout_s: u64,
}

impl Default for EgressSettings {
    fn default() -> Self {
        Self {
            allow: Vec::new(),
            providers: BTreeMap::new(),
            max_connections_per_agent: 64,
            idle_timeout_s: 600,
        }
    }
}

/// `[sandbox]`: every process started for an agent runs inside a `bwrap` sandbox of its
/// own (see docs/security.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxSettings {
    /// `enforce` (default) or `off`.
    pub mode: SandboxMode,
    /// `proxy` (default: a network namespace of its own, the world reached only through
    /// agentry's egress proxy), `none` (loopback only) or `host` (the host's network).
    /// With `mode = "off"` and no `network` set, `host`.
    pub network: SandboxNetwork,
    /// Let agents run in unattended modes when they cannot be sandboxed (default false).
    pub allow_unconfined_unattended: bool,
    /// Absolute paths mounted read-only into every sandbox (a JDK, a toolchain).
    pub extra_read_only: Vec<PathBuf>,
    /// The bubblewrap executable (default `bwrap`, looked up on PATH).
    pub bwrap: String,
}

impl Default for SandboxSettings {
    fn default() -> Self {
        Self {
            mode: SandboxMode::Enforce,
            network: SandboxNetwork::Proxy,
            allow_unconfined_unattended: false,
            extra_read_only: Vec::new(),
            bwrap: "bwrap".to_owned(),
        }
    }
}

/// `[egress.providers.<id>]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EgressProviderSettings {
    /// The hosts the provider's agents may reach instead of its built-in list.
    pub allow: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxMode {
    Enforce,
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxNetwork {
    Host,
    None,
    /// A network namespace of its own; the world only through agentry's egress proxy.
    Proxy,
}

/// `[server]`: how the HTTP server sees its clients.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSettings {
    /// Proxies (CIDR blocks, or single addresses) whose `X-Forwarded-For` is believed
    /// for the client address that rate limits key on (default none: the TCP peer).
    pub trusted_proxies: Vec<String>,
}

/// A block of IP addresses, `198.51.100.0/24` or `2001:db8::/32` (a single address is
/// a block of one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpBlock {
    addr: std::net::IpAddr,
    prefix: u8,
}

impl IpBlock {
    pub fn parse(s: &str) -> Option<Self> {
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s.trim(), None),
        };
        let addr: std::net::IpAddr = addr.parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => p.parse().ok()?,
            Some(_) => return None,
            None => max,
        };
        (prefix <= max).then_some(Self { addr, prefix })
    }

    /// `ip` is in the block (an IPv4-mapped IPv6 address counts as its IPv4 address).
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr;
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        let bits = |a: IpAddr| match a {
            IpAddr::V4(v) => (u128::from(u32::from(v)), 32u32),
            IpAddr::V6(v) => (u128::from(v), 128u32),
        };
        let ((net, width), (candidate, cwidth)) = (bits(self.addr), bits(ip));
        if width != cwidth {
            return false;
        }
        let host_bits = width - u32::from(self.prefix);
        if host_bits >= 128 {
            return true;
        }
        (net >> host_bits) == (candidate >> host_bits)
    }
}

impl ServerSettings {
    /// The trusted proxies, parsed (validated at start).
    pub fn trusted_proxy_blocks(&self) -> Vec<IpBlock> {
        self.trusted_proxies
            .iter()
            .filter_map(|b| IpBlock::parse(b))
            .collect()
    }
}

/// `[mcp]`: stdio MCP servers are the server's own commands, defined here and named by
/// agents (`mcp_servers: {"<name>": {"server": "<settings name>"}}`); members give remote
/// servers by URL only.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct McpSettings {
    /// Let remote MCP server URLs name loopback, private and link-local addresses
    /// (default false: the same address rule as team hooks).
    pub allow_private_networks: bool,
    /// `[mcp.servers.<name>]`.
    pub servers: BTreeMap<String, McpServerSetting>,
}

/// One `[mcp.servers.<name>]` table: a stdio MCP server the server may start for agents.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServerSetting {
    /// The program (looked up on PATH by the provider CLI that starts it).
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    /// Its environment; values are credentials, never shown.
    #[serde(default)]
    pub env: BTreeMap<String, Secret>,
    /// The names of the teams that may use it; absent: every team.
    pub teams: Option<Vec<String>>,
}

impl McpServerSetting {
    /// Whether a team named `team` may use this server.
    pub fn allows(&self, team: &str) -> bool {
        self.teams
            .as_ref()
            .is_none_or(|t| t.iter().any(|n| n == team))
    }
}

/// `[projects]`: which local repositories teams may register, and how repositories
/// cloned from a `git_url` are kept and refreshed.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProjectSettings {
    /// Where clones of `git_url` projects live (`<id>.git` each); a path every replica
    /// reaches. Default `<data_dir>/repos`.
    pub storage_dir: Option<PathBuf>,
    /// Seconds the first clone of a `git_url` project may take (default 300).
    pub clone_timeout_s: u64,
    /// Seconds the fetch before each new workspace may take (default 120).
    pub fetch_timeout_s: u64,
    /// Let `git_url` name loopback, private and link-local hosts (default false).
    pub allow_private_remotes: bool,
    /// Directories under which the named teams may register local repositories
    /// (`[[projects.local_roots]]`); elsewhere only server admins may.
    pub local_roots: Vec<LocalRoot>,
    /// Remote branches a workspace is never pushed to (default `main`, `master`).
    pub protected_branches: Vec<String>,
}

impl Default for ProjectSettings {
    fn default() -> Self {
        Self {
            storage_dir: None,
            clone_timeout_s: 300,
            fetch_timeout_s: 120,
            allow_private_remotes: false,
            local_roots: Vec::new(),
            protected_branches: vec!["main".into(), "master".into()],
        }
    }
}

/// One `[[projects.local_roots]]` table: `path` and the teams (by name or `team_…` id)
/// whose owners may register repositories under it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalRoot {
    pub path: PathBuf,
    pub teams: Vec<String>,
}

impl ProjectSettings {
    /// Where clones live, for a server whose data dir is `data_dir`.
    pub fn storage(&self, data_dir: &Path) -> PathBuf {
        self.storage_dir
            .clone()
            .unwrap_or_else(|| data_dir.join("repos"))
    }

    fn validate(&self) -> Result<(), SettingsError> {
        if self.storage_dir.as_ref().is_some_and(|d| !d.is_absolute()) {
            return Err(invalid("projects.storage_dir", "must be an absolute path"));
        }
        if !(1..=86_400).contains(&self.clone_timeout_s) {
            return Err(invalid(
                "projects.clone_timeout_s",
                "must be between 1 and 86400 seconds",
            ));
        }
        if !(1..=86_400).contains(&self.fetch_timeout_s) {
            return Err(invalid(
                "projects.fetch_timeout_s",
                "must be between 1 and 86400 seconds",
            ));
        }
        if self
            .protected_branches
            .iter()
            .any(|b| b.trim().is_empty() || b.chars().any(|c| c.is_control() || c.is_whitespace()))
        {
            return Err(invalid(
                "projects.protected_branches",
                "must be branch names (no spaces or control characters)",
            ));
        }
        for root in &self.local_roots {
            let p = &root.path;
            if !p.is_absolute() || p.components().any(|c| c == std::path::Component::ParentDir) {
                return Err(invalid(
                    "projects.local_roots",
                    format!("`{}` must be an absolute path without `..`", p.display()),
                ));
            }
            if p.parent().is_none() {
                return Err(invalid(
                    "projects.local_roots",
                    "`/` cannot be a root: name the directories teams may use",
                ));
            }
            if root.teams.is_empty() || root.teams.iter().any(|t| t.trim().is_empty()) {
                return Err(invalid(
                    "projects.local_roots",
                    format!("`{}` must name at least one team", p.display()),
                ));
            }
        }
        Ok(())
    }
}

/// `[hooks]`: how hooks are called, and the server-wide hooks of the settings file
/// (`[[hooks.server]]`; a file that only lists hooks may also write them as `[[hooks]]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HookSettings {
    /// Seconds a receiver has to answer one call (default 30); a waiting hook that does
    /// not answer in time fails its operation.
    pub timeout_s: u64,
    /// Let team hooks reach loopback, private and link-local addresses (default false).
    pub allow_private_networks: bool,
    /// When set, hook URLs must name one of these hosts (exact, case-insensitive).
    pub allowed_hosts: Option<Vec<String>>,
    /// Server-wide hooks, read-only in the API; each is known by an id derived from its
    /// name, so deliveries keep their hook across restarts.
    pub server: Vec<FileHook>,
}

impl Default for HookSettings {
    fn default() -> Self {
        Self {
            timeout_s: 30,
            allow_private_networks: false,
            allowed_hosts: None,
            server: Vec::new(),
        }
    }
}

/// One `[[hooks.server]]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileHook {
    pub name: String,
    pub events: Vec<String>,
    pub url: String,
    pub secret: Secret,
    pub project_id: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default = "yes")]
    pub enabled: bool,
}

fn yes() -> bool {
    true
}

/// `[secrets]`: AES-256-GCM keys for team secrets, each 32 random bytes in base64
/// (`openssl rand -base64 32`). Without `key` the server generates one at
/// `<data_dir>/secrets-key` (mode 0600) on first start.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SecretsSettings {
    /// Encrypts new values and decrypts values stored under it.
    pub key: Option<Secret>,
    /// Earlier keys, only to decrypt what they encrypted until `agentry secrets rotate`
    /// re-encrypts it under `key`.
    pub previous_keys: Vec<Secret>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseSettings {
    /// `postgres://…`; absent → the embedded PostgreSQL.
    pub url: Option<Secret>,
    /// Size of the connection pool; see `pool_size` for the default.
    pub max_connections: Option<u32>,
    /// Longest time, in milliseconds, one database call made for a request may take,
    /// waiting for a connection included (default 5,000); past it the request answers 503
    /// `store_unavailable` and the connection is closed, not reused.
    pub statement_deadline_ms: u64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSettings {
    /// `[auth.oidc]`: bearer JWTs from an OpenID Connect provider, and browser sign-in.
    pub oidc: Option<OidcSettings>,
}

/// `[auth.oidc]`: the identity provider whose JWTs are accepted as bearer tokens, and
/// the browser sign-in (authorization code flow with PKCE) against it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OidcSettings {
    /// Exactly the `iss` of the provider's tokens; discovery reads
    /// `<issuer>/.well-known/openid-configuration`.
    pub issuer: String,
    /// Accepted `aud` values of bearer tokens: a token must name at least one.
    pub audience: Vec<String>,
    /// Overrides the `jwks_uri` of the discovery document.
    #[serde(default)]
    pub jwks_uri: Option<String>,
    /// Signature algorithms accepted (default RS256, PS256, ES256, EdDSA). `none` and
    /// the HMAC algorithms (HS*) are refused at start.
    #[serde(default = "default_allowed_algs")]
    pub allowed_algs: Vec<String>,
    /// The claim holding the user's groups (a list of strings, or one string).
    #[serde(default = "default_groups_claim")]
    pub groups_claim: String,
    #[serde(default = "default_email_claim")]
    pub email_claim: String,
    #[serde(default = "default_name_claim")]
    pub name_claim: String,
    /// Clock skew allowed on `exp`, `nbf` and `iat`, in seconds.
    #[serde(default = "default_leeway_s")]
    pub leeway_s: u64,
    /// An unknown `kid` refetches the JWKS at most this often, in seconds.
    #[serde(default = "default_jwks_refetch_min_interval_s")]
    pub jwks_refetch_min_interval_s: u64,
    /// IdP groups whose members are server admins (default none).
    #[serde(default)]
    pub admin_groups: Vec<String>,
    /// Browser sign-in: the client registered at the provider. Without it, only bearer
    /// tokens are accepted and `/auth/login` answers 404.
    #[serde(default)]
    pub client_id: Option<String>,
    #[serde(default)]
    pub client_secret: Option<Secret>,
    /// Where the provider sends the browser back: `https://<this server>/auth/callback`.
    #[serde(default)]
    pub redirect_url: Option<String>,
    #[serde(default = "default_scopes")]
    pub scopes: String,
    /// A browser session ends after this many seconds without a request…
    #[serde(default = "default_session_idle_s")]
    pub session_idle_s: u64,
    /// …and this many seconds after sign-in, whatever happens.
    #[serde(default = "default_session_absolute_s")]
    pub session_absolute_s: u64,
    /// The longest lifetime, in days, of a personal API token of a user of this provider;
    /// a token asked for without `expires_in_days` gets this one.
    #[serde(default = "default_max_token_days")]
    pub max_token_days: u32,
    /// A browser session is checked with the provider again at least this often, in
    /// seconds: as refresh tokens are not kept, the session then ends and its user signs in
    /// again (their groups, teams and admin rights read anew).
    #[serde(default = "default_session_recheck_s")]
    pub session_recheck_s: u64,
    /// `[auth.oidc.groups]`: IdP group name → the team its members join, and the role.
    #[serde(default)]
    pub groups: BTreeMap<String, GroupMapping>,
    /// The provider verifies every address it sends, so an email without an
    /// `email_verified` claim counts as verified (default false: only `true` does).
    #[serde(default)]
    pub assume_email_verified: bool,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GroupMapping {
    /// The team's name; it is created on first use.
    pub team: String,
    /// `owner`, `member` or `viewer`.
    pub role: String,
}

/// The signature algorithms the OIDC validator implements.
pub const OIDC_SUPPORTED_ALGS: [&str; 9] = [
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA",
];

fn default_allowed_algs() -> Vec<String> {
    ["RS256", "PS256", "ES256", "EdDSA"]
        .map(String::from)
        .to_vec()
}
fn default_groups_claim() -> String {
    "groups".into()
}
fn default_email_claim() -> String {
    "email".into()
}
fn default_name_claim() -> String {
    "name".into()
}
fn default_leeway_s() -> u64 {
    60
}
fn default_jwks_refetch_min_interval_s() -> u64 {
    30
}
fn default_scopes() -> String {
    "openid email profile".into()
}
fn default_session_idle_s() -> u64 {
    8 * 3600
}
fn default_session_absolute_s() -> u64 {
    7 * 24 * 3600
}

fn default_session_recheck_s() -> u64 {
    900
}

fn default_max_token_days() -> u32 {
    90
}

impl OidcSettings {
    /// Settings for `issuer` and `audience` with every default (for tests and tools).
    pub fn new(issuer: impl Into<String>, audience: Vec<String>) -> Self {
        Self {
            issuer: issuer.into(),
            audience,
            jwks_uri: None,
            allowed_algs: default_allowed_algs(),
            groups_claim: default_groups_claim(),
            email_claim: default_email_claim(),
            name_claim: default_name_claim(),
            leeway_s: default_leeway_s(),
            jwks_refetch_min_interval_s: default_jwks_refetch_min_interval_s(),
            admin_groups: Vec::new(),
            client_id: None,
            client_secret: None,
            redirect_url: None,
            scopes: default_scopes(),
            session_idle_s: default_session_idle_s(),
            session_absolute_s: default_session_absolute_s(),
            max_token_days: default_max_token_days(),
            session_recheck_s: default_session_recheck_s(),
            groups: BTreeMap::new(),
            assume_email_verified: false,
        }
    }

    /// Browser sign-in is configured (a client id and a redirect URL).
    pub fn browser_sign_in(&self) -> bool {
        self.client_id.is_some() && self.redirect_url.is_some()
    }

    fn validate(&self) -> Result<(), SettingsError> {
        let http_url = |u: &str| u.starts_with("https://") || u.starts_with("http://");
        if !http_url(&self.issuer) {
            return Err(invalid(
                "auth.oidc.issuer",
                "must be an https:// (or http://) URL",
            ));
        }
        if self.audience.is_empty() || self.audience.iter().any(|a| a.is_empty()) {
            return Err(invalid(
                "auth.oidc.audience",
                "must list at least one audience, none of them empty",
            ));
        }
        if let Some(u) = &self.jwks_uri
            && !http_url(u)
        {
            return Err(invalid("auth.oidc.jwks_uri", "must be an http(s) URL"));
        }
        if self.allowed_algs.is_empty() {
            return Err(invalid("auth.oidc.allowed_algs", "must not be empty"));
        }
        for alg in &self.allowed_algs {
            if alg.eq_ignore_ascii_case("none") || alg.to_ascii_uppercase().starts_with("HS") {
                return Err(invalid(
                    "auth.oidc.allowed_algs",
                    format!(
                        "`{alg}` is never accepted: unsigned and shared-secret (HMAC) tokens \
                         cannot be verified with the provider's public keys"
                    ),
                ));
            }
            if !OIDC_SUPPORTED_ALGS.contains(&alg.as_str()) {
                return Err(invalid(
                    "auth.oidc.allowed_algs",
                    format!(
                        "`{alg}` is not supported (supported: {})",
                        OIDC_SUPPORTED_ALGS.join(", ")
                    ),
                ));
            }
        }
        for (name, claim) in [
            ("groups_claim", &self.groups_claim),
            ("email_claim", &self.email_claim),
            ("name_claim", &self.name_claim),
        ] {
            if claim.is_empty() {
                return Err(invalid(&format!("auth.oidc.{name}"), "must not be empty"));
            }
        }
        if self.client_id.is_some() != self.redirect_url.is_some() {
            return Err(invalid(
                if self.client_id.is_some() {
                    "auth.oidc.redirect_url"
                } else {
                    "auth.oidc.client_id"
                },
                "browser sign-in needs both client_id and redirect_url",
            ));
        }
        if let Some(u) = &self.redirect_url {
            let ok = url::Url::parse(u)
                .ok()
                .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
            if ok.is_none() {
                return Err(invalid(
                    "auth.oidc.redirect_url",
                    "must be an absolute http(s) URL: this server's public /auth/callback",
                ));
            }
        }
        if !self.scopes.split_whitespace().any(|s| s == "openid") {
            return Err(invalid("auth.oidc.scopes", "must include `openid`"));
        }
        if self.session_idle_s == 0 || self.session_absolute_s < self.session_idle_s {
            return Err(invalid(
                "auth.oidc.session_absolute_s",
                "sessions need session_idle_s >= 1 and session_absolute_s >= session_idle_s",
            ));
        }
        if self.session_recheck_s == 0 {
            return Err(invalid("auth.oidc.session_recheck_s", "must be at least 1"));
        }
        if !(1..=3650).contains(&self.max_token_days) {
            return Err(invalid("auth.oidc.max_token_days", "must be 1 to 3650"));
        }
        for (group, m) in &self.groups {
            let name = format!("auth.oidc.groups.{group}");
            if !matches!(m.role.as_str(), "owner" | "member" | "viewer") {
                return Err(invalid(
                    &format!("{name}.role"),
                    "must be `owner`, `member` or `viewer`",
                ));
            }
            if m.team.trim().is_empty() {
                return Err(invalid(&format!("{name}.team"), "must name a team"));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSettings {
    /// `text` (default) or `json`.
    pub format: String,
    /// A tracing filter, e.g. `info,agentry=debug`. `RUST_LOG` wins when set.
    pub filter: String,
    /// OTLP/HTTP endpoint for traces; the exporter runs only when set.
    pub otlp_endpoint: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Largest prompt text accepted, in bytes.
    pub max_prompt_bytes: usize,
    /// Longest `wait` a client may ask for, in seconds.
    pub max_wait_s: u64,
    /// Event streams (`GET …/events`) one principal (a token, a session) may hold open
    /// on one server at once.
    pub max_streams_per_principal: usize,
    /// `wait` calls one principal may have running on one server at once.
    pub max_waits_per_principal: usize,
    /// Agents of one team that are not archived.
    pub max_agents_per_team: i64,
    /// Workspaces of one team that are not archived.
    pub max_workspaces_per_team: i64,
    /// Projects of one team.
    pub max_projects_per_team: i64,
    /// Model catalog refreshes (`GET /v1/providers/{id}/models?refresh=true`) one team
    /// may start per minute on one server; past it the cached catalog is answered.
    pub catalog_refreshes_per_minute: u32,
    /// How deep a tree of agents may grow: an agent created with an agent's token is one
    /// level below it (an agent a person or a bot created is at depth 0); creating one
    /// deeper than this is refused (409 `agent_depth_exceeded`).
    pub max_agent_depth: i32,
    /// Children one agent may have that are not archived (429 `agent_children_exceeded`).
    pub max_children_per_agent: i64,
    /// Agents of one team created by other agents that are not archived (429
    /// `team_children_exceeded`).
    pub max_child_agents_per_team: i64,
    /// Turns running at once on the whole deployment (every replica); a prompt past it
    /// waits in the fair queue (`GET /v1/queue`). 0: no limit. Default: what this host
    /// stands (`HostCapacity::running_turns`).
    pub max_running_turns: i64,
    /// Turns of one team running at once; 0: no limit.
    pub max_running_turns_per_team: i64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventSettings {
    /// Flush a batch at this many events…
    pub batch_max_events: usize,
    /// …or after this many milliseconds, whichever comes first.
    pub batch_linger_ms: u64,
    /// Team events and the state they announce (turn starts and ends, status changes)
    /// wait this many milliseconds to share a commit, so that a burst of them (a thousand
    /// turns ending at once) does not take a commit for every one or two.
    pub team_linger_ms: u64,
    /// Events buffered per SSE connection before it resyncs from the database.
    pub subscriber_buffer: usize,
    /// Seconds between SSE keep-alive comments.
    pub ping_interval_s: u64,
    /// Seconds, at most, between two checks of the caller of an open stream or `wait`
    /// (besides the check on every change heard); 1 to 30.
    pub revalidate_s: u64,
    /// Events accepted but not yet committed, at most; past it producers wait (the
    /// agents stop reading their providers' output until the database catches up).
    pub queue_max_events: usize,
    /// The same bound in (approximate) bytes of event data.
    pub queue_max_bytes: usize,
    /// Longest wait, in milliseconds, for a write the API must confirm; past it the
    /// request answers 503 `store_unavailable`.
    pub commit_wait_ms: u64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProviderSettings {
    pub enabled: Option<bool>,
    /// `acp` for any ACP agent.
    pub extends: Option<String>,
    /// argv of the CLI; the first element is looked up on PATH.
    pub command: Option<Vec<String>>,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub label: Option<String>,
    pub default_mode: Option<String>,
    pub modes: Vec<ModeSetting>,
    /// Environment variables each team supplies as a team secret (for example
    /// `ANTHROPIC_API_KEY`); the provider is unavailable to a team that has not set them.
    pub team_secrets: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModeSetting {
    pub id: String,
    pub label: Option<String>,
    pub description: Option<String>,
    #[serde(default)]
    pub unattended: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            data_dir: default_data_dir(),
            replica_id: None,
            database: DatabaseSettings::default(),
            auth: AuthSettings::default(),
            log: LogSettings::default(),
            limits: Limits::default(),
            events: EventSettings::default(),
            agents: AgentSettings::default(),
            workspaces: WorkspaceSettings::default(),
            metrics: MetricsSettings::default(),
            cluster: ClusterSettings::default(),
            providers: BTreeMap::new(),
            secrets: SecretsSettings::default(),
            hooks: HookSettings::default(),
            server: ServerSettings::default(),
            mcp: McpSettings::default(),
            projects: ProjectSettings::default(),
            egress: EgressSettings::default(),
            sandbox: SandboxSettings::default(),
            usage: UsageSettings::default(),
            triggers: TriggerSettings::default(),
            config_file: None,
            bridge_program: None,
        }
    }
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: None,
            max_connections: None,
            statement_deadline_ms: 5000,
        }
    }
}

impl DatabaseSettings {
    /// Pool size with an external database (`url`) unless set.
    pub const EXTERNAL_POOL: u32 = 32;

    /// `max_connections`, or its default: `EXTERNAL_POOL` for a database at `url`; for
    /// the embedded PostgreSQL, which runs on this host's CPUs,
    /// `HostCapacity::database_connections`.
    pub fn pool_size(&self) -> u32 {
        self.max_connections.unwrap_or_else(|| match self.url {
            Some(_) => Self::EXTERNAL_POOL,
            None => HostCapacity::measure().database_connections(),
        })
    }
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            format: "text".into(),
            filter: "info".into(),
            otlp_endpoint: None,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 1024 * 1024,
            max_prompt_bytes: 256 * 1024,
            max_wait_s: 3600,
            max_streams_per_principal: 128,
            max_waits_per_principal: 256,
            max_agents_per_team: 500,
            max_workspaces_per_team: 1000,
            max_projects_per_team: 200,
            catalog_refreshes_per_minute: 6,
            max_agent_depth: 3,
            max_children_per_agent: 10,
            max_child_agents_per_team: 100,
            max_running_turns: HostCapacity::measure().running_turns(),
            max_running_turns_per_team: 0,
        }
    }
}

/// What this host has for agents' turns, read when the settings are made: the CPUs the
/// process may use (cgroup quota included) and its memory (the cgroup's limit when lower
/// than the machine's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostCapacity {
    pub cpus: i64,
    /// MiB; `None` when it cannot be read.
    pub memory_mib: Option<i64>,
}

impl HostCapacity {
    /// Turns per CPU: a turn's CLI mostly waits on its model, working in bursts (tool
    /// calls, the builds and tests it runs).
    pub const TURNS_PER_CPU: i64 = 4;
    /// MiB per turn: a working CLI was measured at about 300 MB resident (an OpenCode
    /// session; the Node-based CLIs are alike), plus what its tools start.
    pub const MIB_PER_TURN: i64 = 512;

    pub fn measure() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as i64);
        let machine = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
            })
            .map(|kib| kib / 1024);
        let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
            .ok()
            .and_then(|v| v.trim().parse::<i64>().ok())
            .map(|bytes| bytes / (1024 * 1024));
        let memory_mib = match (machine, cgroup) {
            (Some(m), Some(c)) => Some(m.min(c)),
            (m, c) => m.or(c),
        };
        Self { cpus, memory_mib }
    }

    /// Connections per CPU to a database on this host.
    pub const CONNECTIONS_PER_CPU: i64 = 4;

    /// The embedded database's default pool: `CONNECTIONS_PER_CPU` per CPU, between 8 and
    /// `DatabaseSettings::EXTERNAL_POOL`. Its backends run on the same CPUs as the server
    /// and the agents: more than a few per CPU only contend, and each new one starts cold
    /// (200 agents created at once on 2 CPUs: 18.0–18.7 ms of CPU per agent with 32
    /// connections, 15.3–15.6 ms with 8).
    pub fn database_connections(self) -> u32 {
        (self.cpus.max(1) * Self::CONNECTIONS_PER_CPU)
            .clamp(8, i64::from(DatabaseSettings::EXTERNAL_POOL)) as u32
    }

    /// The default of `limits.max_running_turns`: `TURNS_PER_CPU` per CPU and one per
    /// `MIB_PER_TURN` of memory, whichever is fewer, and at least 2.
    pub fn running_turns(self) -> i64 {
        let by_cpu = self.cpus.max(1) * Self::TURNS_PER_CPU;
        let by_memory = self.memory_mib.map_or(by_cpu, |m| m / Self::MIB_PER_TURN);
        by_cpu.min(by_memory).max(2)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentSettings {
    /// Seconds an agent may sit idle (no turn, no pending permission request) before its
    /// provider process is stopped; the next prompt resumes the same conversation.
    /// 0 keeps idle processes running.
    pub idle_timeout_s: u64,
    /// The CPU priority (`nice`, 0–19) of agent processes and everything they start: 10
    /// by default, below the server and its database, so that recording and streaming
    /// events keeps its share of the cores while agents build and test. 0 runs them at
    /// the server's own priority.
    pub nice: i32,
    /// `[agents.limits]`: what each agent's process tree may use.
    pub limits: AgentLimitsSettings,
    /// The address of this server's `/mcp` endpoint as an agent's process reaches it
    /// (the `agentry` MCP server each agent is given): by default `http://127.0.0.1:<port>/mcp`
    /// when the server listens on a loopback or unspecified address, else
    /// `http://<listen address>/mcp`.
    pub agentry_mcp_url: Option<String>,
}

impl Default for AgentSettings {
    fn default() -> Self {
        Self {
            idle_timeout_s: 900,
            nice: 10,
            limits: AgentLimitsSettings::default(),
            agentry_mcp_url: None,
        }
    }
}

/// `[agents.limits]`: resource limits of each agent's process tree (its CLI and all it
/// starts) and of each workspace setup or teardown command. Where each one holds depends
/// on the host (cgroups or rlimits only): see docs/security.md.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentLimitsSettings {
    /// Memory of the whole tree, as a whole number with a unit: `"512MiB"`, `"4GiB"`
    /// (units `B`, `KiB`, `MiB`, `GiB`, `TiB`), at least 64 MiB; `"unlimited"` sets none.
    pub memory: String,
    /// Processes and threads of the whole tree at once; 0 sets no limit.
    pub max_processes: u64,
    /// CPU share of each agent relative to the other agents, 1–10000 (100 is the
    /// cgroup v2 default weight; agents as a whole weigh as one group beside the server).
    pub cpu_weight: u32,
    /// Open files per process (`RLIMIT_NOFILE`); 0 keeps the server's own limit.
    pub open_files: u64,
}

impl Default for AgentLimitsSettings {
    fn default() -> Self {
        Self {
            memory: "4GiB".into(),
            max_processes: 512,
            cpu_weight: 100,
            open_files: 4096,
        }
    }
}

/// The smallest memory limit accepted: below it no agent CLI starts.
const MIN_AGENT_MEMORY: u64 = 64 << 20;

impl AgentLimitsSettings {
    /// The memory limit in bytes (`None`: unlimited).
    pub fn memory_bytes(&self) -> Result<Option<u64>, String> {
        let text = self.memory.trim();
        if text == "unlimited" {
            return Ok(None);
        }
        let bytes = parse_byte_size(text).ok_or_else(|| {
            format!("`{text}` is not a size such as \"512MiB\" or \"4GiB\" (or \"unlimited\")")
        })?;
        if bytes < MIN_AGENT_MEMORY {
            return Err("must be at least 64MiB".into());
        }
        Ok(Some(bytes))
    }

    fn validate(&self) -> Result<(), SettingsError> {
        self.memory_bytes()
            .map_err(|m| invalid("agents.limits.memory", m))?;
        if self.max_processes != 0 && self.max_processes < 16 {
            return Err(invalid(
                "agents.limits.max_processes",
                "must be 0 (no limit) or at least 16",
            ));
        }
        if !(1..=10_000).contains(&self.cpu_weight) {
            return Err(invalid(
                "agents.limits.cpu_weight",
                "must be between 1 and 10000",
            ));
        }
        if self.open_files != 0 && self.open_files < 64 {
            return Err(invalid(
                "agents.limits.open_files",
                "must be 0 (the server's own limit) or at least 64",
            ));
        }
        Ok(())
    }
}

/// `<whole number><unit>` with a binary unit (`B`, `KiB`, `MiB`, `GiB`, `TiB`).
fn parse_byte_size(text: &str) -> Option<u64> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(split);
    if number.is_empty() {
        return None;
    }
    let shift = match unit.trim_start() {
        "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        "TiB" => 40,
        _ => return None,
    };
    number.parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

/// `[metrics]`: `GET /metrics` answers anyone who can reach it unless `token` is set;
/// then it asks for `Authorization: Bearer <token>`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSettings {
    pub token: Option<Secret>,
}

/// `[cluster]`: how this server takes part in a deployment of several replicas sharing
/// one database.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSettings {
    /// This replica's id (default: the host name plus a random suffix, chosen once per
    /// host and data dir and kept in `<data_dir>/replica-<host>`, so a restart is the same
    /// replica).
    pub replica_id: Option<String>,
    /// Seconds an agent's lease lasts unrenewed; a replica silent this long is taken for
    /// dead and its agents are taken over (default 15).
    pub lease_ttl_s: u64,
    /// How other replicas reach this one (default: `http://` plus the address it listens
    /// on, the host name standing in for an unspecified address).
    pub advertise_url: Option<String>,
    /// Seconds a stopping replica waits for running turns to end before it stops their
    /// agents (default 30).
    pub drain_timeout_s: u64,
}

impl Default for ClusterSettings {
    fn default() -> Self {
        Self {
            replica_id: None,
            lease_ttl_s: 15,
            advertise_url: None,
            drain_timeout_s: 30,
        }
    }
}

/// `[workspaces]`: bounds on the repository's own setup and teardown commands
/// (`.agentry.toml`, `[worktree] setup` / `teardown`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkspaceSettings {
    /// Seconds all setup commands of a new worktree may take together; past it they are
    /// stopped and the workspace is `setup_failed`.
    pub setup_timeout_s: u64,
    /// Seconds all teardown commands may take before an archive goes on without them.
    pub teardown_timeout_s: u64,
}

impl Default for WorkspaceSettings {
    fn default() -> Self {
        Self {
            setup_timeout_s: 600,
            teardown_timeout_s: 120,
        }
    }
}

impl Default for EventSettings {
    fn default() -> Self {
        Self {
            batch_max_events: 4096,
            batch_linger_ms: 0,
            team_linger_ms: 10,
            subscriber_buffer: 1024,
            ping_interval_s: 15,
            revalidate_s: 30,
            queue_max_events: 50_000,
            queue_max_bytes: 64 << 20,
            commit_wait_ms: 5000,
        }
    }
}

fn default_data_dir() -> PathBuf {
    match std::env::var_os("HOME") {
        Some(home) if !home.is_empty() => Path::new(&home).join(".local/share/agentry"),
        _ => PathBuf::from("/var/lib/agentry/data"),
    }
}

/// A setting that failed validation, named so the user can find it.
#[derive(Debug, thiserror::Error)]
#[error("invalid setting `{setting}`: {message}")]
pub struct SettingsError {
    pub setting: String,
    pub message: String,
}

fn invalid(setting: &str, message: impl Into<String>) -> SettingsError {
    SettingsError {
        setting: setting.into(),
        message: message.into(),
    }
}

impl Settings {
    /// Defaults < `file` (when given) < the process environment.
    pub fn load(file: Option<&Path>) -> Result<Self, SettingsError> {
        let env: Vec<(String, String)> = std::env::vars().collect();
        Self::load_from(file, &env)
    }

    /// Like `load`, with an explicit environment (for tests).
    pub fn load_from(file: Option<&Path>, env: &[(String, String)]) -> Result<Self, SettingsError> {
        let mut table = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    invalid("config", format!("cannot read {}: {e}", path.display()))
                })?;
                text.parse::<toml::Table>()
                    .map_err(|e| invalid("config", format!("{}: {e}", path.display())))?
            }
            None => toml::Table::new(),
        };
        // `[[hooks]]` alone is the list of server hooks: the same as `[[hooks.server]]`.
        if let Some(toml::Value::Array(list)) = table.get("hooks") {
            let list = list.clone();
            table.insert(
                "hooks".into(),
                toml::Value::Table(toml::Table::from_iter([(
                    "server".to_owned(),
                    toml::Value::Array(list),
                )])),
            );
        }
        for (name, raw) in env {
            let path: Vec<String> = if name == "DATABASE_URL" {
                if env.iter().any(|(n, _)| n == "AGENTRY_DATABASE__URL") {
                    continue;
                }
                vec!["database".into(), "url".into()]
            } else if let Some(rest) = name.strip_prefix("AGENTRY_") {
                if rest.is_empty() || NOT_SETTINGS.contains(&name.as_str()) {
                    continue;
                }
                env_path(rest)
            } else {
                continue;
            };
            if path.iter().any(String::is_empty) {
                return Err(invalid(
                    name,
                    "is not a setting name (empty key between `__`)",
                ));
            }
            let value = if typed_setting(&path) {
                typed_value(raw)
            } else {
                toml::Value::String(raw.clone())
            };
            set_path(&mut table, &path, value);
        }
        check_providers(&table)?;
        let network_set = table
            .get("sandbox")
            .and_then(|s| s.get("network"))
            .is_some();
        let mut settings: Settings = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| invalid(&setting_name_of(&e), e.message()))?;
        // Without the sandbox there is no network of its own: the default is the host's.
        if settings.sandbox.mode == SandboxMode::Off && !network_set {
            settings.sandbox.network = SandboxNetwork::Host;
        }
        settings.config_file =
            file.map(|f| std::fs::canonicalize(f).unwrap_or_else(|_| f.to_owned()));
        settings.validated()
    }

    fn validated(mut self) -> Result<Self, SettingsError> {
        self.listen_addr()?;
        if self.data_dir.as_os_str().is_empty() {
            return Err(invalid("data_dir", "must not be empty"));
        }
        if self.data_dir.is_relative() {
            let cwd = std::env::current_dir().map_err(|e| invalid("data_dir", e.to_string()))?;
            self.data_dir = cwd.join(&self.data_dir);
        }
        if let Some(url) = &self.database.url {
            let u = url.expose();
            if !(u.starts_with("postgres://") || u.starts_with("postgresql://")) {
                return Err(invalid(
                    "database.url",
                    "must start with postgres:// or postgresql://",
                ));
            }
        }
        if self.sandbox.mode == SandboxMode::Off && self.sandbox.network != SandboxNetwork::Host {
            return Err(invalid(
                "sandbox.network",
                "takes effect only in the sandbox: with sandbox.mode = \"off\" agents use the host's network; set it to \"host\" or turn the sandbox on",
            ));
        }
        if self.database.max_connections == Some(0) {
            return Err(invalid("database.max_connections", "must be at least 1"));
        }
        if let Some(bad) = self
            .sandbox
            .extra_read_only
            .iter()
            .find(|p| p.is_relative())
        {
            return Err(invalid(
                "sandbox.extra_read_only",
                format!("`{}` is not an absolute path", bad.display()),
            ));
        }
        if self.sandbox.bwrap.trim().is_empty() {
            return Err(invalid("sandbox.bwrap", "must not be empty"));
        }
        if !(0..=19).contains(&self.agents.nice) {
            return Err(invalid("agents.nice", "must be between 0 and 19"));
        }
        self.agents.limits.validate()?;
        self.usage.validate()?;
        self.triggers.validate()?;
        if self.database.statement_deadline_ms == 0 {
            return Err(invalid(
                "database.statement_deadline_ms",
                "must be at least 1",
            ));
        }
        if let Some(oidc) = &self.auth.oidc {
            oidc.validate()?;
        }
        if let Some(bad) = self
            .server
            .trusted_proxies
            .iter()
            .find(|b| IpBlock::parse(b).is_none())
        {
            return Err(invalid(
                "server.trusted_proxies",
                format!("`{bad}` is not an IP address or CIDR block (like 10.0.0.0/8)"),
            ));
        }
        if !matches!(self.log.format.as_str(), "text" | "json") {
            return Err(invalid("log.format", "must be `text` or `json`"));
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.filter) {
            return Err(invalid("log.filter", format!("not a tracing filter: {e}")));
        }
        if let Some(url) = &self.log.otlp_endpoint
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err(invalid(
                "log.otlp_endpoint",
                "must be an http:// or https:// URL",
            ));
        }
        if self.limits.max_body_bytes < 1024 {
            return Err(invalid("limits.max_body_bytes", "must be at least 1024"));
        }
        if self.limits.max_prompt_bytes == 0
            || self.limits.max_prompt_bytes > self.limits.max_body_bytes
        {
            return Err(invalid(
                "limits.max_prompt_bytes",
                "must be between 1 and limits.max_body_bytes",
            ));
        }
        for (setting, value) in [
            (
                "limits.max_streams_per_principal",
                self.limits.max_streams_per_principal as i64,
            ),
            (
                "limits.max_waits_per_principal",
                self.limits.max_waits_per_principal as i64,
            ),
            (
                "limits.max_agents_per_team",
                self.limits.max_agents_per_team,
            ),
            (
                "limits.max_workspaces_per_team",
                self.limits.max_workspaces_per_team,
            ),
            (
                "limits.max_projects_per_team",
                self.limits.max_projects_per_team,
            ),
            (
                "limits.max_children_per_agent",
                self.limits.max_children_per_agent,
            ),
            (
                "limits.max_child_agents_per_team",
                self.limits.max_child_agents_per_team,
            ),
        ] {
            if value < 1 {
                return Err(invalid(setting, "must be at least 1"));
            }
        }
        if !(0..=100).contains(&self.limits.max_agent_depth) {
            return Err(invalid(
                "limits.max_agent_depth",
                "must be between 0 and 100",
            ));
        }
        if let Some(url) = &self.agents.agentry_mcp_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err(invalid(
                "agents.agentry_mcp_url",
                "must be an http:// or https:// URL",
            ));
        }
        for (setting, value) in [
            ("limits.max_running_turns", self.limits.max_running_turns),
            (
                "limits.max_running_turns_per_team",
                self.limits.max_running_turns_per_team,
            ),
        ] {
            if value < 0 {
                return Err(invalid(setting, "must be 0 (no limit) or more"));
            }
        }
        for (name, server) in &self.mcp.servers {
            let setting = format!("mcp.servers.{name}");
            if name.is_empty()
                || name.len() > 100
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            {
                return Err(invalid(
                    &setting,
                    "names are 1 to 100 letters, digits or `-_.`",
                ));
            }
            if server.command.is_empty() {
                return Err(invalid(&format!("{setting}.command"), "must not be empty"));
            }
            if server
                .teams
                .as_ref()
                .is_some_and(|t| t.iter().any(String::is_empty))
            {
                return Err(invalid(
                    &format!("{setting}.teams"),
                    "team names must not be empty",
                ));
            }
        }
        if let Some(t) = &self.metrics.token
            && t.expose().len() < 16
        {
            return Err(invalid("metrics.token", "must be at least 16 characters"));
        }
        if self.replica_id.is_some() && self.cluster.replica_id.is_some() {
            return Err(invalid(
                "replica_id",
                "is the older spelling of `cluster.replica_id`; set only one of them",
            ));
        }
        if let Some(id) = self
            .cluster
            .replica_id
            .as_ref()
            .or(self.replica_id.as_ref())
            && (id.is_empty()
                || id.len() > 128
                || !id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b)))
        {
            return Err(invalid(
                "cluster.replica_id",
                "must be 1 to 128 letters, digits or `-_.:`",
            ));
        }
        if !(3..=600).contains(&self.cluster.lease_ttl_s) {
            return Err(invalid(
                "cluster.lease_ttl_s",
                "must be between 3 and 600 seconds",
            ));
        }
        if let Some(url) = &self.cluster.advertise_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err(invalid(
                "cluster.advertise_url",
                "must be an http:// or https:// URL",
            ));
        }
        if self.workspaces.setup_timeout_s == 0 {
            return Err(invalid("workspaces.setup_timeout_s", "must be at least 1"));
        }
        if self.workspaces.teardown_timeout_s == 0 {
            return Err(invalid(
                "workspaces.teardown_timeout_s",
                "must be at least 1",
            ));
        }
        self.projects.validate()?;
        if !(1..=4096).contains(&self.egress.max_connections_per_agent) {
            return Err(invalid(
                "egress.max_connections_per_agent",
                "must be between 1 and 4096",
            ));
        }
        if !(1..=86_400).contains(&self.egress.idle_timeout_s) {
            return Err(invalid(
                "egress.idle_timeout_s",
                "must be between 1 and 86400 seconds",
            ));
        }
        if self.events.batch_max_events == 0 {
            return Err(invalid("events.batch_max_events", "must be at least 1"));
        }
        if self.events.subscriber_buffer < 16 {
            return Err(invalid("events.subscriber_buffer", "must be at least 16"));
        }
        if self.events.ping_interval_s == 0 {
            return Err(invalid("events.ping_interval_s", "must be at least 1"));
        }
        if !(1..=30).contains(&self.events.revalidate_s) {
            return Err(invalid("events.revalidate_s", "must be 1 to 30"));
        }
        if self.events.queue_max_events == 0 || self.events.queue_max_events > u32::MAX as usize {
            return Err(invalid(
                "events.queue_max_events",
                "must be between 1 and 4294967295",
            ));
        }
        if self.events.queue_max_bytes < 1024 || self.events.queue_max_bytes > u32::MAX as usize {
            return Err(invalid(
                "events.queue_max_bytes",
                "must be between 1024 and 4294967295",
            ));
        }
        if self.events.commit_wait_ms == 0 {
            return Err(invalid("events.commit_wait_ms", "must be at least 1"));
        }
        // A write the API confirms would otherwise time out while it lingers.
        for (setting, ms) in [
            ("events.batch_linger_ms", self.events.batch_linger_ms),
            ("events.team_linger_ms", self.events.team_linger_ms),
        ] {
            if ms >= self.events.commit_wait_ms {
                return Err(invalid(setting, "must be less than events.commit_wait_ms"));
            }
        }
        if let Some(key) = &self.secrets.key {
            decode_secrets_key(key).map_err(|m| invalid("secrets.key", m))?;
        }
        for (i, key) in self.secrets.previous_keys.iter().enumerate() {
            decode_secrets_key(key)
                .map_err(|m| invalid(&format!("secrets.previous_keys[{i}]"), m))?;
        }
        if self.hooks.timeout_s == 0 || self.hooks.timeout_s > 300 {
            return Err(invalid("hooks.timeout_s", "must be between 1 and 300"));
        }
        for (i, h) in self.hooks.server.iter().enumerate() {
            let at = |key: &str| format!("hooks.server[{i}].{key}");
            if h.name.trim().is_empty() || h.name.len() > 100 {
                return Err(invalid(&at("name"), "must be 1 to 100 characters"));
            }
            if self.hooks.server[..i].iter().any(|o| o.name == h.name) {
                return Err(invalid(&at("name"), format!("`{}` is used twice", h.name)));
            }
            if h.secret.expose().is_empty() {
                return Err(invalid(&at("secret"), "must not be empty"));
            }
            if h.events.is_empty() {
                return Err(invalid(&at("events"), "must name at least one event"));
            }
        }
        for (id, p) in &self.providers {
            if !valid_provider_id(id) {
                return Err(invalid(
                    &format!("providers.{id}"),
                    "ids are lowercase letters, digits and `-`",
                ));
            }
            if let Some(cmd) = &p.command
                && cmd.is_empty()
            {
                return Err(invalid(
                    &format!("providers.{id}.command"),
                    "must name a program",
                ));
            }
            for (i, name) in p.team_secrets.iter().enumerate() {
                let setting = format!("providers.{id}.team_secrets");
                if !valid_env_name(name) {
                    return Err(invalid(
                        &setting,
                        format!(
                            "`{name}` is not a secret name (an environment variable name: \
                             A-Z, 0-9 and `_`, not starting with a digit, at most 128)"
                        ),
                    ));
                }
                if p.team_secrets[..i].contains(name) {
                    return Err(invalid(&setting, format!("`{name}` is named twice")));
                }
                if p.env.contains_key(name) {
                    return Err(invalid(
                        &setting,
                        format!(
                            "`{name}` is also set in providers.{id}.env; a variable comes \
                             from one place"
                        ),
                    ));
                }
            }
            if id == "mock"
                && let Some(cmd) = &p.command
                && cmd.len() > 1
            {
                return Err(invalid(
                    &format!("providers.{id}.command"),
                    "the built-in provider runs one program (the agentry executable); \
                     it takes no arguments",
                ));
            }
        }
        Ok(self)
    }

    pub fn listen_addr(&self) -> Result<SocketAddr, SettingsError> {
        self.listen.parse().map_err(|_| {
            invalid(
                "listen",
                format!("`{}` is not an address like 127.0.0.1:8080", self.listen),
            )
        })
    }

    /// This replica's id: `cluster.replica_id` (or the older `replica_id`), else the host
    /// name plus a random suffix chosen once and kept in `<data_dir>/replica-<host>`.
    pub fn replica(&self) -> String {
        if let Some(id) = self
            .cluster
            .replica_id
            .as_ref()
            .or(self.replica_id.as_ref())
        {
            return id.clone();
        }
        let host = std::fs::read_to_string("/etc/hostname")
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty() && s.len() <= 100)
            .unwrap_or_else(|| "local".into());
        let file = self.data_dir.join(format!("replica-{host}"));
        if let Ok(id) = std::fs::read_to_string(&file) {
            let id = id.trim();
            if !id.is_empty() {
                return id.to_owned();
            }
        }
        let suffix = &uuid::Uuid::now_v7().simple().to_string()[24..];
        let id = format!("{host}-{suffix}");
        // Unwritable data dir: the id lives as long as this process.
        let _ = std::fs::create_dir_all(&self.data_dir).and_then(|_| std::fs::write(&file, &id));
        id
    }
}

/// An environment variable name as team secrets use them: an uppercase letter or `_`,
/// then up to 127 uppercase letters, digits or `_` (`^[A-Z_][A-Z0-9_]{0,127}$`).
pub fn valid_env_name(name: &str) -> bool {
    match name.as_bytes().split_first() {
        Some((first, rest)) => {
            (first.is_ascii_uppercase() || *first == b'_')
                && rest.len() <= 127
                && rest
                    .iter()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || *b == b'_')
        }
        None => false,
    }
}

/// A `[secrets]` key: standard base64 (padding optional, surrounding space ignored) of
/// exactly 32 bytes.
pub fn decode_secrets_key(key: &Secret) -> Result<[u8; 32], String> {
    use base64::Engine;
    let text = key.expose().trim();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(text))
        .map_err(|_| "is not base64 (make one with `openssl rand -base64 32`)".to_owned())?;
    <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| {
        format!(
            "decodes to {} bytes; an AES-256 key is 32 (make one with `openssl rand -base64 32`)",
            bytes.len()
        )
    })
}

fn valid_provider_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 40
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Variables that start with `AGENTRY_` but are not server settings: the settings file,
/// the command-line client's server and token, and what the test suite and the CI scripts
/// read (the seed of randomized tests, the real-CLI suites' sandbox network, where the pinned agent CLIs, test peers, Playwright
/// and deploy tools are cached, the dashboard test's Chromium and screenshots, rewriting
/// the committed OpenAPI document). A developer exports these in the shell that also
/// runs `agentry serve`, so they must not stop it. `AGENTRY_REQUIRE_CLIS` is retired (a
/// missing test peer now always fails) but is still let through for shells that export
/// it. `every_variable_the_tests_and_ci_read_is_let_through` keeps this list complete.
const NOT_SETTINGS: &[&str] = &[
    "AGENTRY_CONFIG",
    "AGENTRY_URL",
    "AGENTRY_TOKEN",
    "AGENTRY_TEST_SEED",
    "AGENTRY_TEST_SANDBOX_NETWORK",
    "AGENTRY_CLI_CACHE",
    "AGENTRY_REQUIRE_CLIS",
    "AGENTRY_TEST_PEERS_CACHE",
    "AGENTRY_PLAYWRIGHT_CACHE",
    "AGENTRY_CHROMIUM",
    "AGENTRY_SCREENSHOTS",
    "AGENTRY_BLESS",
    "AGENTRY_DEPLOY_TOOLS",
];

/// The CLI providers this server implements: the one list of them. The settings accept a
/// `[providers.<id>]` table (and `extends = "<id>"`) for each, and the provider registry
/// builds its built-ins from it (`providers::registry::builtins` matches on every
/// variant), so the two cannot drift apart. It lives here because the settings are a
/// leaf layer that cannot ask the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuiltInCli {
    Claude,
    Codex,
    Copilot,
    Gemini,
    OpenCode,
    Pi,
}

impl BuiltInCli {
    pub const ALL: [Self; 6] = [
        Self::Claude,
        Self::Codex,
        Self::Copilot,
        Self::Gemini,
        Self::OpenCode,
        Self::Pi,
    ];

    /// The provider id (the settings table's name).
    pub const fn id(self) -> &'static str {
        match self {
            Self::Claude => "claude",
            Self::Codex => "codex",
            Self::Copilot => "copilot",
            Self::Gemini => "gemini",
            Self::OpenCode => "opencode",
            Self::Pi => "pi",
        }
    }

    pub fn from_id(id: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.id() == id)
    }
}

/// The keys the built-in `mock` provider's table may carry.
const MOCK_PROVIDER_KEYS: [&str; 2] = ["enabled", "command"];

/// The keys of the provider built in as `id` (`mock` or a `BuiltInCli`), or `None` when
/// `id` is not built in (it needs `extends = "acp"` or another built-in's id).
fn built_in_provider_keys(id: &str) -> Option<&'static [&'static str]> {
    if id == "mock" {
        Some(&MOCK_PROVIDER_KEYS)
    } else {
        BuiltInCli::from_id(id).map(|_| &CLI_PROVIDER_KEYS[..])
    }
}

/// What a table can extend: `acp`, or a built-in CLI (`extends = "claude"` makes a second
/// Claude profile).
fn extendable(kind: &str) -> bool {
    kind == "acp" || BuiltInCli::from_id(kind).is_some()
}

fn extendable_list() -> String {
    std::iter::once("acp")
        .chain(BuiltInCli::ALL.map(BuiltInCli::id))
        .map(|e| format!("`{e}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The keys a built-in CLI provider's table may carry.
const CLI_PROVIDER_KEYS: [&str; 8] = [
    "enabled",
    "command",
    "args",
    "env",
    "label",
    "default_mode",
    "modes",
    "team_secrets",
];

/// The keys a provider table with `extends = "acp"` may carry (all of them are used).
const ACP_PROVIDER_KEYS: [&str; 9] = [
    "enabled",
    "extends",
    "command",
    "args",
    "env",
    "label",
    "default_mode",
    "modes",
    "team_secrets",
];

/// The settings path an `AGENTRY_` variable names (the part after the prefix).
fn env_path(rest: &str) -> Vec<String> {
    let parts: Vec<&str> = rest.split("__").collect();
    let mut path: Vec<String> = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        let in_providers = path.first().is_some_and(|p| p == "providers");
        let in_egress_providers = path.len() == 2 && path[..2] == ["egress", "providers"];
        if (in_providers && path.len() == 1) || in_egress_providers {
            path.push(part.to_ascii_lowercase().replace('_', "-"));
        } else if in_providers && path.len() == 3 && path[2] == "env" {
            path.push(parts[i..].join("__"));
            break;
        } else if path.len() == 3 && path[..3] == ["auth", "oidc", "groups"] {
            // An IdP group name is data: kept as written.
            path.push(part.to_string());
        } else {
            path.push(part.to_ascii_lowercase());
        }
    }
    path
}

/// Settings that are numbers, booleans or lists; every other setting is text. Add a
/// setting here when it is not a string, so that its environment value is read as TOML.
fn typed_setting(path: &[String]) -> bool {
    let path: Vec<&str> = path.iter().map(String::as_str).collect();
    matches!(
        path.as_slice(),
        ["database", "max_connections" | "statement_deadline_ms"]
            | ["limits", _]
            | ["events", _]
            | ["agents", _]
            | [
                "agents",
                "limits",
                "max_processes" | "cpu_weight" | "open_files"
            ]
            | ["cluster", "lease_ttl_s" | "drain_timeout_s"]
            | ["workspaces", "setup_timeout_s" | "teardown_timeout_s"]
            | [
                "projects",
                "clone_timeout_s"
                    | "fetch_timeout_s"
                    | "allow_private_remotes"
                    | "local_roots"
                    | "protected_branches"
            ]
            | [
                "providers",
                _,
                "enabled" | "command" | "args" | "modes" | "team_secrets"
            ]
            | ["secrets", "previous_keys"]
            | ["usage", "ledger" | "max_team_cost_usd" | "max_team_tokens"]
            | ["usage", "prices", _, _, _]
            | [
                "hooks",
                "timeout_s" | "allow_private_networks" | "allowed_hosts"
            ]
            | ["mcp", "allow_private_networks"]
            | [
                "triggers",
                "max_body_bytes"
                    | "missed_after_s"
                    | "run_lease_s"
                    | "max_concurrent_runs"
                    | "pr_poll_s"
                    | "pr_poll_batch"
            ]
            | [
                "egress",
                "allow" | "max_connections_per_agent" | "idle_timeout_s"
            ]
            | ["egress", "providers", _, "allow"]
            | ["mcp", "servers", _, "args" | "teams"]
            | [
                "auth",
                "oidc",
                "audience"
                    | "allowed_algs"
                    | "admin_groups"
                    | "leeway_s"
                    | "jwks_refetch_min_interval_s"
                    | "session_idle_s"
                    | "session_absolute_s"
            ]
    )
}

/// An environment value for a typed setting: a TOML value when it parses as one
/// (`8080`, `true`, `["a"]`), else the text (which deserializing then refuses by name).
fn typed_value(raw: &str) -> toml::Value {
    format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .filter(|v| !v.is_table())
        .unwrap_or_else(|| toml::Value::String(raw.to_owned()))
}

fn set_path(table: &mut toml::Table, path: &[String], value: toml::Value) {
    let (last, parents) = path.split_last().expect("non-empty path");
    let mut cur = table;
    for key in parents {
        let entry = cur
            .entry(key.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if !entry.is_table() {
            *entry = toml::Value::Table(toml::Table::new());
        }
        cur = entry.as_table_mut().expect("table");
    }
    cur.insert(last.clone(), value);
}

/// Refuse provider tables the server would not use: an id that is neither built in nor
/// `extends = "acp"`, and keys its kind does not use. Runs on the merged table, so it
/// sees exactly the keys the file and the environment set.
fn check_providers(table: &toml::Table) -> Result<(), SettingsError> {
    let Some(providers) = table.get("providers") else {
        return Ok(());
    };
    let Some(providers) = providers.as_table() else {
        return Err(invalid("providers", "must be a table of provider tables"));
    };
    for (id, p) in providers {
        let name = format!("providers.{id}");
        let Some(p) = p.as_table() else {
            return Err(invalid(&name, "must be a table"));
        };
        let allowed: &[&str] = match p.get("extends") {
            Some(toml::Value::String(kind)) if extendable(kind) => {
                if built_in_provider_keys(id).is_some() {
                    return Err(invalid(
                        &format!("{name}.extends"),
                        format!(
                            "`{id}` is a built-in provider; a profile that extends another needs an id of its own"
                        ),
                    ));
                }
                &ACP_PROVIDER_KEYS
            }
            Some(_) => {
                return Err(invalid(
                    &format!("{name}.extends"),
                    format!("can extend only {}", extendable_list()),
                ));
            }
            None => match built_in_provider_keys(id) {
                Some(keys) => keys,
                None => {
                    return Err(invalid(
                        &name,
                        format!(
                            "`{id}` is not a provider this server implements (built in: \
                             {}); for an ACP agent add `extends = \"acp\"`",
                            std::iter::once("mock")
                                .chain(BuiltInCli::ALL.map(BuiltInCli::id))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    ));
                }
            },
        };
        if let Some(key) = p.keys().find(|k| !allowed.contains(&k.as_str())) {
            let kind = if let Some(base) = p.get("extends").and_then(|e| e.as_str()) {
                format!("a provider extending `{base}`")
            } else {
                format!("the built-in `{id}` provider")
            };
            return Err(invalid(
                &format!("{name}.{key}"),
                format!(
                    "{kind} does not use this key (it uses: {})",
                    allowed.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

/// The dotted name of the setting a deserialization error is about.
fn setting_name_of(e: &toml::de::Error) -> String {
    // The error's display ends with "in `<path>`" when it is about a nested key; an
    // unknown key is named in the message itself.
    let msg = e.message();
    let shown = e.to_string();
    let path = shown
        .strip_prefix(msg)
        .map(str::trim)
        .and_then(|rest| rest.strip_prefix("in `"))
        .and_then(|rest| rest.strip_suffix('`'))
        .filter(|p| !p.is_empty());
    let unknown = msg
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.find('`').map(|end| &rest[..end]));
    match (path, unknown) {
        (Some(p), Some(k)) => format!("{p}.{k}"),
        (None, Some(k)) => k.to_owned(),
        (Some(p), None) => p.to_owned(),
        (None, None) => "config".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_defaults_to_a_few_connections_per_cpu_for_the_embedded_database() {
        let host = |cpus| HostCapacity {
            cpus,
            memory_mib: None,
        };
        let sizes: Vec<u32> = [1, 2, 3, 4, 8, 64]
            .map(|c| host(c).database_connections())
            .to_vec();
        assert_eq!(sizes, [8, 8, 12, 16, 32, 32]);
        let embedded = DatabaseSettings::default();
        assert_eq!(
            embedded.pool_size(),
            HostCapacity::measure().database_connections()
        );
        let external = DatabaseSettings {
            url: Some(Secret::new("postgres://db/agentry")),
            ..DatabaseSettings::default()
        };
        assert_eq!(external.pool_size(), DatabaseSettings::EXTERNAL_POOL);
        let set = DatabaseSettings {
            max_connections: Some(3),
            ..external
        };
        assert_eq!(set.pool_size(), 3);
    }

    #[test]
    fn the_running_turn_default_follows_the_fewer_of_cpus_and_memory() {
        let host = |cpus, memory_mib| HostCapacity { cpus, memory_mib };
        // 2 CPUs, 23.5 GiB: bounded by the CPUs.
        assert_eq!(host(2, Some(24_064)).running_turns(), 8);
        // 16 CPUs, 8 GiB: bounded by memory.
        assert_eq!(host(16, Some(8_192)).running_turns(), 16);
        // A small container still runs two; unreadable memory leaves the CPUs' bound.
        assert_eq!(host(1, Some(512)).running_turns(), 2);
        assert_eq!(host(3, None).running_turns(), 12);
        let measured = HostCapacity::measure();
        assert!(measured.cpus >= 1, "{measured:?}");
        assert_eq!(
            Limits::default().max_running_turns,
            measured.running_turns()
        );
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn layers_defaults_file_and_env() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("agentry.toml");
        std::fs::write(
            &file,
            "listen = \"127.0.0.1:9000\"\ndata_dir = \"/srv/a\"\n[limits]\nmax_wait_s = 10\n",
        )
        .unwrap();
        let s = Settings::load_from(
            Some(&file),
            &env(&[
                ("AGENTRY_LISTEN", "0.0.0.0:7000"),
                ("DATABASE_URL", "postgres://u:pw@h/db"),
            ]),
        )
        .unwrap();
        assert_eq!(s.listen, "0.0.0.0:7000");
        assert_eq!(s.data_dir, PathBuf::from("/srv/a"));
        assert_eq!(s.limits.max_wait_s, 10);
        assert_eq!(
            s.database.url.as_ref().unwrap().expose(),
            "postgres://u:pw@h/db"
        );
        assert!(
            !format!("{s:?}").contains("pw@"),
            "secrets are redacted in Debug"
        );
    }

    #[test]
    fn nested_env_and_numbers() {
        let s = Settings::load_from(None, &env(&[("AGENTRY_LIMITS__MAX_WAIT_S", "42")])).unwrap();
        assert_eq!(s.limits.max_wait_s, 42);
    }

    #[test]
    fn errors_name_the_setting() {
        let e = Settings::load_from(None, &env(&[("AGENTRY_LISTEN", "nope")])).unwrap_err();
        assert_eq!(e.setting, "listen");
        let e =
            Settings::load_from(None, &env(&[("AGENTRY_DATABASE__URL", "mysql://x")])).unwrap_err();
        assert_eq!(e.setting, "database.url");
        let e = Settings::load_from(None, &env(&[("AGENTRY_LOG__FORMAT", "xml")])).unwrap_err();
        assert_eq!(e.setting, "log.format");
        let e = Settings::load_from(None, &env(&[("AGENTRY_BOGUS", "1")])).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }

    /// The `AGENTRY_*` variables the test suite and the CI scripts read from their
    /// environment, by how each kind of file reads one.
    fn variables_read_by_tests_and_ci() -> std::collections::BTreeSet<String> {
        fn files(dir: &Path, out: &mut Vec<PathBuf>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    files(&path, out);
                } else {
                    out.push(path);
                }
            }
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut all = Vec::new();
        files(&root.join("tests"), &mut all);
        files(&root.join(".ci"), &mut all);
        let mut found = std::collections::BTreeSet::new();
        for path in all {
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            let readers: &[&str] = match ext {
                "rs" => &["var(\"", "var_os(\""],
                "py" => &["environ.get(\"", "environ[\"", "getenv(\""],
                "js" | "mjs" => &["process.env."],
                // The scripts in .ci/ have no extension.
                "" | "sh" => &["${", "$", "export "],
                _ => continue,
            };
            for reader in readers {
                for (at, _) in text.match_indices(&format!("{reader}AGENTRY_")) {
                    let name: String = text[at + reader.len()..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    found.insert(name);
                }
            }
        }
        found
    }

    #[test]
    fn every_variable_the_tests_and_ci_read_is_let_through() {
        let read = variables_read_by_tests_and_ci();
        // The scan sees each way of reading one.
        for known in [
            "AGENTRY_TEST_SEED",
            "AGENTRY_PLAYWRIGHT_CACHE",
            "AGENTRY_CHROMIUM",
            "AGENTRY_DEPLOY_TOOLS",
        ] {
            assert!(read.contains(known), "{known} not found in {read:?}");
        }
        for name in &read {
            assert!(
                Settings::load_from(None, &env(&[(name.as_str(), "/tmp/x")])).is_ok(),
                "`agentry serve` refuses to start when {name} (read by the tests or CI) is \
                 exported: add it to NOT_SETTINGS"
            );
        }
        assert!(Settings::load_from(None, &env(&[("AGENTRY_PLAYWRIGHT_CACHE", "/x")])).is_ok());
    }

    fn file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agentry.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    fn refused(text: &str, env_pairs: &[(&str, &str)]) -> SettingsError {
        let (_dir, path) = file(text);
        Settings::load_from(Some(&path), &env(env_pairs)).expect_err("the settings are refused")
    }

    #[test]
    fn egress_lists_and_bounds_are_read_and_checked() {
        let (_dir, path) = file(
            "[egress]\nallow = [\"pypi.org\"]\nidle_timeout_s = 30\n\
             [egress.providers.claude]\nallow = [\"llm-gateway.internal:8443\"]\n",
        );
        let s = Settings::load_from(
            Some(&path),
            &env(&[
                (
                    "AGENTRY_EGRESS__PROVIDERS__MY_AGENT__ALLOW",
                    "[\"api.example.com\"]",
                ),
                ("AGENTRY_EGRESS__MAX_CONNECTIONS_PER_AGENT", "8"),
            ]),
        )
        .unwrap();
        assert_eq!(s.egress.allow, ["pypi.org"]);
        assert_eq!(s.egress.idle_timeout_s, 30);
        assert_eq!(s.egress.max_connections_per_agent, 8);
        assert_eq!(
            s.egress.providers["claude"].allow,
            ["llm-gateway.internal:8443"]
        );
        assert_eq!(s.egress.providers["my-agent"].allow, ["api.example.com"]);
        let d = Settings::default().egress;
        assert!(d.allow.is_empty() && d.providers.is_empty());
        assert_eq!((d.max_connections_per_agent, d.idle_timeout_s), (64, 600));
        let e = refused("[egress]\ndeny = []\n", &[]);
        assert!(e.to_string().contains("deny"), "{e}");
        let e = refused("[egress.providers.claude]\nallow = []\nblock = []\n", &[]);
        assert!(e.to_string().contains("block"), "{e}");
        let e = refused("[egress]\nmax_connections_per_agent = 0\n", &[]);
        assert_eq!(e.setting, "egress.max_connections_per_agent");
        let e = refused("[egress]\nidle_timeout_s = 0\n", &[]);
        assert_eq!(e.setting, "egress.idle_timeout_s");
    }

    #[test]
    fn every_sandbox_network_mode_is_accepted_and_proxy_is_the_default() {
        assert_eq!(Settings::default().sandbox.network, SandboxNetwork::Proxy);
        let s = Settings::load_from(None, &[]).unwrap();
        assert_eq!(s.sandbox.network, SandboxNetwork::Proxy);
        // The sandbox turned off, and no network named: the host's.
        let (_dir, path) = file("[sandbox]\nmode = \"off\"\n");
        let s = Settings::load_from(Some(&path), &[]).unwrap();
        assert_eq!(s.sandbox.network, SandboxNetwork::Host);
        let s =
            Settings::load_from(None, &[("AGENTRY_SANDBOX__MODE".into(), "off".into())]).unwrap();
        assert_eq!(s.sandbox.network, SandboxNetwork::Host);
        for (name, mode) in [
            ("host", SandboxNetwork::Host),
            ("none", SandboxNetwork::None),
            ("proxy", SandboxNetwork::Proxy),
        ] {
            let (_dir, path) = file(&format!("[sandbox]\nnetwork = \"{name}\"\n"));
            let s = Settings::load_from(Some(&path), &[]).unwrap();
            assert_eq!(s.sandbox.network, mode);
        }
        let e = refused("[sandbox]\nnetwork = \"vpn\"\n", &[]);
        assert!(e.to_string().contains("vpn"), "{e}");
        // Without the sandbox a network mode other than the host's could not be kept.
        for name in ["none", "proxy"] {
            let e = refused(
                &format!("[sandbox]\nmode = \"off\"\nnetwork = \"{name}\"\n"),
                &[],
            );
            assert!(e.to_string().contains("sandbox.network"), "{e}");
        }
        // Not a setting: a file cannot name the bridge's program.
        let e = refused("bridge_program = \"/bin/sh\"\n", &[]);
        assert!(e.to_string().contains("bridge_program"), "{e}");
    }

    #[test]
    fn trusted_proxies_are_read_and_checked() {
        let (_dir, path) = file("[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"2001:db8::1\"]\n");
        let s = Settings::load_from(Some(&path), &[]).unwrap();
        assert_eq!(s.server.trusted_proxy_blocks().len(), 2);
        assert!(Settings::default().server.trusted_proxies.is_empty());
        let e = refused("[server]\ntrusted_proxies = [\"10.0.0.0/99\"]\n", &[]);
        assert!(e.to_string().contains("server.trusted_proxies"), "{e}");
        let e = refused("[server]\nproxies = []\n", &[]);
        assert!(e.to_string().contains("proxies"), "{e}");
    }

    #[test]
    fn mcp_servers_and_limits_are_read_and_checked() {
        let (_dir, path) = file(
            "[mcp.servers.docs]\ncommand = \"docs-mcp\"\nargs = [\"--stdio\"]\n\
             env = { T = \"x\" }\nteams = [\"web\"]\n\
             [mcp.servers.open]\ncommand = \"open-mcp\"\n\
             [limits]\nmax_agents_per_team = 3\n",
        );
        let s = Settings::load_from(Some(&path), &[]).unwrap();
        let docs = &s.mcp.servers["docs"];
        assert_eq!(docs.args, ["--stdio"]);
        assert_eq!(docs.env["T"].expose(), "x");
        assert!(docs.allows("web") && !docs.allows("ops"));
        assert!(s.mcp.servers["open"].allows("anyone"));
        assert!(!s.mcp.allow_private_networks);
        assert_eq!(s.limits.max_agents_per_team, 3);
        assert_eq!(s.limits.max_streams_per_principal, 128);
        let e = refused("[mcp.servers.docs]\ncommand = \"d\"\nshell = true\n", &[]);
        assert!(e.setting.starts_with("mcp.servers"), "{}", e.setting);
        let e = refused("[mcp.servers.docs]\ncommand = \"\"\n", &[]);
        assert_eq!(e.setting, "mcp.servers.docs.command");
        let e = refused("[mcp.servers.\"a b\"]\ncommand = \"d\"\n", &[]);
        assert_eq!(e.setting, "mcp.servers.a b");
        let e = refused("[limits]\nmax_waits_per_principal = 0\n", &[]);
        assert_eq!(e.setting, "limits.max_waits_per_principal");
        let e = refused("", &[("AGENTRY_LIMITS__MAX_PROJECTS_PER_TEAM", "0")]);
        assert_eq!(e.setting, "limits.max_projects_per_team");
    }

    #[test]
    fn trigger_worker_and_poll_settings_are_read_and_checked() {
        let d = Settings::default().triggers;
        assert_eq!(
            (
                d.run_lease_s,
                d.max_concurrent_runs,
                d.pr_poll_s,
                d.pr_poll_batch
            ),
            (60, 4, 300, 20)
        );
        let s = Settings::load_from(
            None,
            &env(&[
                ("AGENTRY_TRIGGERS__PR_POLL_S", "0"),
                ("AGENTRY_TRIGGERS__RUN_LEASE_S", "30"),
                ("AGENTRY_TRIGGERS__MAX_CONCURRENT_RUNS", "2"),
                ("AGENTRY_TRIGGERS__PR_POLL_BATCH", "5"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (
                s.triggers.pr_poll_s,
                s.triggers.run_lease_s,
                s.triggers.max_concurrent_runs,
                s.triggers.pr_poll_batch
            ),
            (0, 30, 2, 5)
        );
        for (text, setting) in [
            ("[triggers]\npr_poll_s = 86401\n", "triggers.pr_poll_s"),
            ("[triggers]\npr_poll_batch = 0\n", "triggers.pr_poll_batch"),
            ("[triggers]\nrun_lease_s = 1\n", "triggers.run_lease_s"),
            (
                "[triggers]\nmax_concurrent_runs = 0\n",
                "triggers.max_concurrent_runs",
            ),
        ] {
            assert_eq!(refused(text, &[]).setting, setting, "{text}");
        }
    }

    #[test]
    fn project_settings_are_read_checked_and_unknown_keys_refused() {
        let (_dir, path) = file(
            "[projects]\nstorage_dir = \"/srv/repos\"\nclone_timeout_s = 60\n\
             allow_private_remotes = true\n\
             [[projects.local_roots]]\npath = \"/srv/git/web\"\nteams = [\"web\"]\n",
        );
        let s = Settings::load_from(Some(&path), &[]).unwrap();
        assert_eq!(
            s.projects.storage(Path::new("/d")),
            PathBuf::from("/srv/repos")
        );
        assert_eq!(
            (s.projects.clone_timeout_s, s.projects.fetch_timeout_s),
            (60, 120)
        );
        assert!(s.projects.allow_private_remotes);
        assert_eq!(s.projects.local_roots[0].teams, ["web"]);
        assert_eq!(s.projects.protected_branches, ["main", "master"]);
        let s = Settings::load_from(
            None,
            &env(&[("AGENTRY_PROJECTS__PROTECTED_BRANCHES", "[\"release\"]")]),
        )
        .unwrap();
        assert_eq!(s.projects.protected_branches, ["release"]);
        assert_eq!(
            Settings::default().projects.storage(Path::new("/d")),
            PathBuf::from("/d/repos")
        );
        for (text, setting) in [
            (
                "[projects]\nstorage_dir = \"repos\"\n",
                "projects.storage_dir",
            ),
            (
                "[projects]\nclone_timeout_s = 0\n",
                "projects.clone_timeout_s",
            ),
            (
                "[projects]\nfetch_timeout_s = 0\n",
                "projects.fetch_timeout_s",
            ),
            (
                "[[projects.local_roots]]\npath = \"/srv/../etc\"\nteams = [\"web\"]\n",
                "projects.local_roots",
            ),
            (
                "[[projects.local_roots]]\npath = \"/\"\nteams = [\"web\"]\n",
                "projects.local_roots",
            ),
            (
                "[[projects.local_roots]]\npath = \"/srv/git\"\nteams = []\n",
                "projects.local_roots",
            ),
            (
                "[projects]\nallow_file_remotes = true\n",
                "projects.allow_file_remotes",
            ),
            (
                "[projects]\nprotected_branches = [\"main\", \"\"]\n",
                "projects.protected_branches",
            ),
        ] {
            let (_dir, path) = file(text);
            let e = Settings::load_from(Some(&path), &[]).unwrap_err();
            assert_eq!(e.setting, setting, "{text}: {e}");
        }
        let s = Settings::load_from(
            None,
            &env(&[
                ("AGENTRY_PROJECTS__ALLOW_PRIVATE_REMOTES", "true"),
                ("AGENTRY_PROJECTS__FETCH_TIMEOUT_S", "7"),
                (
                    "AGENTRY_PROJECTS__LOCAL_ROOTS",
                    r#"[{path = "/srv/git", teams = ["web"]}]"#,
                ),
            ]),
        )
        .unwrap();
        assert!(s.projects.allow_private_remotes);
        assert_eq!(s.projects.fetch_timeout_s, 7);
        assert_eq!(s.projects.local_roots[0].path, PathBuf::from("/srv/git"));
    }

    #[test]
    fn oidc_settings_are_read_checked_and_unknown_keys_refused() {
        let (_dir, path) = file(
            "[auth.oidc]\nissuer = \"https://idp.example.com\"\naudience = [\"agentry\"]\n\
             client_id = \"agentry-web\"\nredirect_url = \"https://agentry.example.com/auth/callback\"\n\
             [auth.oidc.groups]\nPlatform-Eng = { team = \"platform\", role = \"owner\" }\n",
        );
        let s = Settings::load_from(Some(&path), &[]).unwrap();
        let o = s.auth.oidc.as_ref().unwrap();
        assert_eq!(o.allowed_algs, ["RS256", "PS256", "ES256", "EdDSA"]);
        assert_eq!((o.leeway_s, o.jwks_refetch_min_interval_s), (60, 30));
        assert_eq!(o.groups["Platform-Eng"].team, "platform");
        assert!(o.browser_sign_in());
        let e = refused(
            "[auth.oidc]\nissuer = \"https://i\"\naudience = [\"a\"]\nbogus = 1\n",
            &[],
        );
        assert_eq!(e.setting, "auth.oidc.bogus");
        for alg in ["none", "HS256"] {
            let e = refused(
                &format!(
                    "[auth.oidc]\nissuer = \"https://i\"\naudience = [\"a\"]\nallowed_algs = [\"RS256\", \"{alg}\"]\n"
                ),
                &[],
            );
            assert_eq!(e.setting, "auth.oidc.allowed_algs", "{e}");
        }
        let e = refused(
            "[auth.oidc]\nissuer = \"https://i\"\naudience = [\"a\"]\n[auth.oidc.groups]\ng = { team = \"t\", role = \"boss\" }\n",
            &[],
        );
        assert_eq!(e.setting, "auth.oidc.groups.g.role");
        let s = Settings::load_from(
            None,
            &env(&[
                ("AGENTRY_AUTH__OIDC__ISSUER", "https://idp.example.com"),
                ("AGENTRY_AUTH__OIDC__AUDIENCE", "[\"agentry\"]"),
                ("AGENTRY_AUTH__OIDC__LEEWAY_S", "5"),
                ("AGENTRY_AUTH__OIDC__GROUPS__Eng_Team__TEAM", "eng"),
                ("AGENTRY_AUTH__OIDC__GROUPS__Eng_Team__ROLE", "viewer"),
            ]),
        )
        .unwrap();
        let o = s.auth.oidc.unwrap();
        assert_eq!(o.leeway_s, 5);
        assert_eq!(o.groups["Eng_Team"].role, "viewer");
    }

    #[test]
    fn provider_tables_the_server_would_not_use_are_refused() {
        // An id that is no provider at all, without `extends`.
        let e = refused("[providers.my-agent]\ncommand = [\"my-agent\"]\n", &[]);
        assert_eq!(e.setting, "providers.my-agent");
        assert!(e.message.contains("extends"), "{e}");
        // Keys the built-in mock does not use.
        for key in [
            "args = [\"-v\"]",
            "env = { A = \"b\" }",
            "label = \"Mock\"",
            "default_mode = \"default\"",
        ] {
            let e = refused(&format!("[providers.mock]\n{key}\n"), &[]);
            let name = key.split(' ').next().unwrap();
            assert_eq!(e.setting, format!("providers.mock.{name}"), "{e}");
        }
        let e = refused(
            "[providers.mock]\ncommand = [\"/usr/bin/agentry\", \"--flag\"]\n",
            &[],
        );
        assert_eq!(e.setting, "providers.mock.command");
        // A key no provider kind has, on an ACP provider; an unknown `extends`.
        let e = refused(
            "[providers.my-agent]\nextends = \"acp\"\ncommand = [\"a\"]\ntimeout = 3\n",
            &[],
        );
        assert_eq!(e.setting, "providers.my-agent.timeout");
        let e = refused("[providers.my-agent]\nextends = \"mock\"\n", &[]);
        assert_eq!(e.setting, "providers.my-agent.extends");
        // A built-in cannot extend another; its table takes no `extends`.
        let e = refused("[providers.claude]\nextends = \"codex\"\n", &[]);
        assert_eq!(e.setting, "providers.claude.extends");
        let e = refused("[providers.codex]\ntimeout = 3\n", &[]);
        assert_eq!(e.setting, "providers.codex.timeout");
        // The same through the environment.
        let e = Settings::load_from(
            None,
            &env(&[("AGENTRY_PROVIDERS__MY_AGENT__ENABLED", "true")]),
        )
        .unwrap_err();
        assert_eq!(e.setting, "providers.my-agent");
        let e = Settings::load_from(None, &env(&[("AGENTRY_PROVIDERS__MOCK__LABEL", "M")]))
            .unwrap_err();
        assert_eq!(e.setting, "providers.mock.label");
    }

    #[test]
    fn provider_tables_the_server_uses_are_accepted() {
        let (_dir, path) = file(
            "[providers.mock]\nenabled = true\ncommand = [\"/usr/bin/agentry\"]\n\
             [providers.my-agent]\nextends = \"acp\"\ncommand = [\"my-agent\", \"--acp\"]\n\
             args = [\"-q\"]\nenv = { K = \"v\" }\nlabel = \"My agent\"\ndefault_mode = \"ask\"\n\
             modes = [ { id = \"ask\", label = \"Ask\" }, { id = \"auto\", unattended = true } ]\n",
        );
        let s = Settings::load_from(Some(&path), &[]).unwrap();
        assert_eq!(s.providers.len(), 2);
        assert_eq!(s.providers["my-agent"].modes.len(), 2);
    }

    #[test]
    fn copilot_tables_are_accepted_as_a_built_in() {
        let (_dir, path) = file(
            "[providers.copilot]\ncommand = [\"/opt/copilot/bin/copilot\"]\n\
             env = { COPILOT_OFFLINE = \"true\", COPILOT_PROVIDER_BASE_URL = \"http://127.0.0.1:9/v1\" }\n\
             default_mode = \"allow-all\"\n\
             [providers.copilot-github]\nextends = \"copilot\"\nlabel = \"Copilot (GitHub)\"\n",
        );
        let s = Settings::load_from(Some(&path), &[]).unwrap();
        assert_eq!(s.providers.len(), 2);
        assert_eq!(
            s.providers["copilot-github"].extends.as_deref(),
            Some("copilot")
        );
        let e = refused("[providers.copilot]\nextends = \"acp\"\n", &[]);
        assert_eq!(e.setting, "providers.copilot.extends");
    }

    #[test]
    fn env_keeps_the_case_of_map_keys_and_spells_ids_with_dashes() {
        let s = Settings::load_from(
            None,
            &env(&[
                ("AGENTRY_PROVIDERS__MY_AGENT__EXTENDS", "acp"),
                (
                    "AGENTRY_PROVIDERS__MY_AGENT__COMMAND",
                    "[\"my-agent\", \"--acp\"]",
                ),
                (
                    "AGENTRY_PROVIDERS__MY_AGENT__ENV__ANTHROPIC_BASE_URL",
                    "http://127.0.0.1:9/x",
                ),
                ("AGENTRY_PROVIDERS__MY_AGENT__ENV__Mixed_Case__Name", "1"),
                ("AGENTRY_PROVIDERS__MY_AGENT__ENABLED", "false"),
            ]),
        )
        .unwrap();
        let p = &s.providers["my-agent"];
        assert_eq!(p.extends.as_deref(), Some("acp"));
        assert_eq!(
            p.command.as_deref(),
            Some(&["my-agent".to_owned(), "--acp".to_owned()][..])
        );
        assert_eq!(p.enabled, Some(false));
        assert_eq!(p.env["ANTHROPIC_BASE_URL"], "http://127.0.0.1:9/x");
        assert_eq!(p.env["Mixed_Case__Name"], "1");
        assert_eq!(p.env.len(), 2);
    }

    #[test]
    fn numeric_looking_env_values_stay_text_where_the_setting_is_text() {
        let s = Settings::load_from(
            None,
            &env(&[
                ("AGENTRY_PROVIDERS__MY_AGENT__EXTENDS", "acp"),
                ("AGENTRY_PROVIDERS__MY_AGENT__ENV__PORT", "8080"),
                ("AGENTRY_PROVIDERS__MY_AGENT__ENV__VERBOSE", "true"),
                ("AGENTRY_PROVIDERS__MY_AGENT__ENV__RATIO", "1.50"),
                ("AGENTRY_PROVIDERS__MY_AGENT__LABEL", "2024"),
                ("AGENTRY_PROVIDERS__MY_AGENT__DEFAULT_MODE", "1"),
                ("AGENTRY_REPLICA_ID", "007"),
                ("AGENTRY_DATA_DIR", "/srv/1"),
                ("AGENTRY_LOG__FILTER", "info"),
            ]),
        )
        .unwrap();
        let p = &s.providers["my-agent"];
        assert_eq!(p.env["PORT"], "8080");
        assert_eq!(p.env["VERBOSE"], "true");
        assert_eq!(p.env["RATIO"], "1.50", "the text as written, not 1.5");
        assert_eq!(p.label.as_deref(), Some("2024"));
        assert_eq!(p.default_mode.as_deref(), Some("1"));
        assert_eq!(s.replica_id.as_deref(), Some("007"));
        assert_eq!(s.data_dir, PathBuf::from("/srv/1"));
    }

    #[test]
    fn agent_limits_are_parsed_and_checked() {
        let d = Settings::load_from(None, &[]).unwrap().agents.limits;
        assert_eq!(d.memory_bytes().unwrap(), Some(4 << 30));
        assert_eq!(
            (d.max_processes, d.cpu_weight, d.open_files),
            (512, 100, 4096)
        );

        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            file.path(),
            "[agents.limits]\nmemory = \"200MiB\"\nmax_processes = 64\nopen_files = 256\n",
        )
        .unwrap();
        let s = Settings::load_from(
            Some(file.path()),
            &env(&[("AGENTRY_AGENTS__LIMITS__CPU_WEIGHT", "50")]),
        )
        .unwrap();
        assert_eq!(s.agents.limits.memory_bytes().unwrap(), Some(200 << 20));
        assert_eq!(s.agents.limits.max_processes, 64);
        assert_eq!(s.agents.limits.open_files, 256);
        assert_eq!(s.agents.limits.cpu_weight, 50);
        let s = Settings::load_from(
            None,
            &env(&[("AGENTRY_AGENTS__LIMITS__MEMORY", "unlimited")]),
        )
        .unwrap();
        assert_eq!(s.agents.limits.memory_bytes().unwrap(), None);

        for (name, value, setting) in [
            (
                "AGENTRY_AGENTS__LIMITS__MEMORY",
                "4G",
                "agents.limits.memory",
            ),
            (
                "AGENTRY_AGENTS__LIMITS__MEMORY",
                "1.5GiB",
                "agents.limits.memory",
            ),
            (
                "AGENTRY_AGENTS__LIMITS__MEMORY",
                "10MiB",
                "agents.limits.memory",
            ),
            (
                "AGENTRY_AGENTS__LIMITS__MEMORY",
                "GiB",
                "agents.limits.memory",
            ),
            (
                "AGENTRY_AGENTS__LIMITS__MAX_PROCESSES",
                "3",
                "agents.limits.max_processes",
            ),
            (
                "AGENTRY_AGENTS__LIMITS__CPU_WEIGHT",
                "0",
                "agents.limits.cpu_weight",
            ),
            (
                "AGENTRY_AGENTS__LIMITS__CPU_WEIGHT",
                "10001",
                "agents.limits.cpu_weight",
            ),
            (
                "AGENTRY_AGENTS__LIMITS__OPEN_FILES",
                "10",
                "agents.limits.open_files",
            ),
            ("AGENTRY_AGENTS__LIMITS__SWAP", "1", "agents.limits.swap"),
        ] {
            let e = Settings::load_from(None, &env(&[(name, value)])).unwrap_err();
            assert_eq!(e.setting, setting, "{name}={value}: {e}");
        }
    }

    #[test]
    fn typed_settings_from_env_are_checked_by_name() {
        let s = Settings::load_from(
            None,
            &env(&[
                ("AGENTRY_DATABASE__MAX_CONNECTIONS", "7"),
                ("AGENTRY_EVENTS__BATCH_LINGER_MS", "2"),
            ]),
        )
        .unwrap();
        assert_eq!(s.database.max_connections, Some(7));
        assert_eq!(s.events.batch_linger_ms, 2);
        let e =
            Settings::load_from(None, &env(&[("AGENTRY_LIMITS__MAX_WAIT_S", "soon")])).unwrap_err();
        assert_eq!(e.setting, "limits.max_wait_s");
        let e = Settings::load_from(None, &env(&[("AGENTRY_DATABASE__MAX_CONNECTIONS", "0")]))
            .unwrap_err();
        assert_eq!(e.setting, "database.max_connections");
        let s = Settings::load_from(None, &env(&[("AGENTRY_AGENTS__NICE", "4")])).unwrap();
        assert_eq!(s.agents.nice, 4);
        for out_of_range in ["20", "-1"] {
            let e = Settings::load_from(None, &env(&[("AGENTRY_AGENTS__NICE", out_of_range)]))
                .unwrap_err();
            assert_eq!(e.setting, "agents.nice");
        }
        let s = Settings::load_from(
            None,
            &env(&[("AGENTRY_DATABASE__STATEMENT_DEADLINE_MS", "1500")]),
        )
        .unwrap();
        assert_eq!(s.database.statement_deadline_ms, 1500);
        let e = Settings::load_from(
            None,
            &env(&[("AGENTRY_DATABASE__STATEMENT_DEADLINE_MS", "0")]),
        )
        .unwrap_err();
        assert_eq!(e.setting, "database.statement_deadline_ms");
    }

    /// Every setting that is not text can be given in the environment.
    #[test]
    fn every_number_and_switch_can_be_set_from_the_environment() {
        let s = Settings::load_from(
            None,
            &env(&[
                ("AGENTRY_CLUSTER__LEASE_TTL_S", "45"),
                ("AGENTRY_CLUSTER__DRAIN_TIMEOUT_S", "5"),
                ("AGENTRY_WORKSPACES__SETUP_TIMEOUT_S", "90"),
                ("AGENTRY_WORKSPACES__TEARDOWN_TIMEOUT_S", "9"),
                ("AGENTRY_AGENTS__IDLE_TIMEOUT_S", "60"),
                ("AGENTRY_HOOKS__TIMEOUT_S", "3"),
                ("AGENTRY_HOOKS__ALLOW_PRIVATE_NETWORKS", "true"),
                ("AGENTRY_EVENTS__COMMIT_WAIT_MS", "700"),
                ("AGENTRY_LIMITS__MAX_WAIT_S", "42"),
                ("AGENTRY_PROVIDERS__MINE__EXTENDS", "acp"),
                (
                    "AGENTRY_PROVIDERS__MINE__COMMAND",
                    r#"["my-agent", "--acp"]"#,
                ),
                ("AGENTRY_PROVIDERS__MINE__ENABLED", "false"),
            ]),
        )
        .unwrap();
        assert_eq!((s.cluster.lease_ttl_s, s.cluster.drain_timeout_s), (45, 5));
        assert_eq!(
            (
                s.workspaces.setup_timeout_s,
                s.workspaces.teardown_timeout_s
            ),
            (90, 9)
        );
        assert_eq!(s.agents.idle_timeout_s, 60);
        assert_eq!(s.hooks.timeout_s, 3);
        assert!(s.hooks.allow_private_networks);
        assert_eq!(s.events.commit_wait_ms, 700);
        assert_eq!(s.limits.max_wait_s, 42);
        assert_eq!(s.providers["mine"].enabled, Some(false));
        assert_eq!(
            s.providers["mine"].command.as_deref(),
            Some(&["my-agent".to_owned(), "--acp".to_owned()][..])
        );
        let e = Settings::load_from(None, &env(&[("AGENTRY_CLUSTER__LEASE_TTL_S", "soon")]))
            .unwrap_err();
        assert_eq!(e.setting, "cluster.lease_ttl_s");
    }

    #[test]
    fn a_linger_as_long_as_the_commit_wait_is_refused() {
        for setting in ["BATCH_LINGER_MS", "TEAM_LINGER_MS"] {
            let var = format!("AGENTRY_EVENTS__{setting}");
            let e = Settings::load_from(None, &env(&[(var.as_str(), "5000")])).unwrap_err();
            assert_eq!(e.setting, format!("events.{}", setting.to_lowercase()));
            let s = Settings::load_from(None, &env(&[(var.as_str(), "4999")])).unwrap();
            assert_eq!(s.events.batch_linger_ms.max(s.events.team_linger_ms), 4999);
        }
    }

    #[test]
    fn hook_settings_and_server_hooks_are_read_in_either_spelling() {
        let (_d, path) = file(
            "[hooks]\ntimeout_s = 5\nallow_private_networks = true\nallowed_hosts = [\"hooks.example.com\"]\n\
             [[hooks.server]]\nname = \"sink\"\nevents = [\"agent.turn.after\"]\n\
             url = \"https://hooks.example.com/in\"\nsecret = \"s3cret\"\n",
        );
        let s = Settings::load_from(Some(&path), &[]).unwrap();
        assert_eq!(s.hooks.timeout_s, 5);
        assert!(s.hooks.allow_private_networks);
        assert_eq!(s.hooks.server[0].name, "sink");
        assert!(s.hooks.server[0].enabled);
        assert!(!format!("{:?}", s.hooks).contains("s3cret"));
        // `[[hooks]]` alone lists server hooks.
        let (_d, path) = file(
            "[[hooks]]\nname = \"a\"\nevents = [\"agent.turn.after\"]\nurl = \"http://x\"\nsecret = \"k\"\n",
        );
        let s = Settings::load_from(Some(&path), &[]).unwrap();
        assert_eq!(s.hooks.server.len(), 1);
        assert_eq!(s.hooks.timeout_s, 30);
        let s = Settings::load_from(
            None,
            &env(&[
                ("AGENTRY_HOOKS__TIMEOUT_S", "7"),
                ("AGENTRY_HOOKS__ALLOW_PRIVATE_NETWORKS", "true"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (s.hooks.timeout_s, s.hooks.allow_private_networks),
            (7, true)
        );
        // Unknown keys and bad values are refused by name.
        let (_d, path) = file("[hooks]\nretries = 3\n");
        let e = Settings::load_from(Some(&path), &[]).unwrap_err();
        assert!(e.to_string().contains("retries"), "{e}");
        let (_d, path) = file("[hooks]\ntimeout_s = 0\n");
        assert_eq!(
            Settings::load_from(Some(&path), &[]).unwrap_err().setting,
            "hooks.timeout_s"
        );
        let (_d, path) =
            file("[[hooks]]\nname = \"a\"\nevents = []\nurl = \"http://x\"\nsecret = \"k\"\n");
        assert_eq!(
            Settings::load_from(Some(&path), &[]).unwrap_err().setting,
            "hooks.server[0].events"
        );
    }

    #[test]
    fn unknown_and_unusable_keys_are_named_with_their_path() {
        let e = refused("[limits]\nmax_wait_s = 5\nmax_waits = 6\n", &[]);
        assert_eq!(e.setting, "limits.max_waits");
        let e = refused("[cluster]\nreplica = \"a\"\n", &[]);
        assert_eq!(e.setting, "cluster.replica");
        let e = refused("replica_id = \"a\"\n[cluster]\nreplica_id = \"b\"\n", &[]);
        assert_eq!(e.setting, "replica_id");
        let e = refused("[cluster]\nlease_ttl_s = 1\n", &[]);
        assert_eq!(e.setting, "cluster.lease_ttl_s");
        let e = refused("[cluster]\nreplica_id = \"a b\"\n", &[]);
        assert_eq!(e.setting, "cluster.replica_id");
        let e = refused("[auth.local]\nenabled = true\n", &[]);
        assert_eq!(e.setting, "auth.local");
        let e = refused("[log]\nfilter = \"info,[\"\n", &[]);
        assert_eq!(e.setting, "log.filter");
        let e = refused("[log]\notlp_endpoint = \"collector:4318\"\n", &[]);
        assert_eq!(e.setting, "log.otlp_endpoint");
        let e = Settings::load_from(None, &env(&[("AGENTRY_EVENTS____X", "1")])).unwrap_err();
        assert_eq!(e.setting, "AGENTRY_EVENTS____X");
    }

    #[test]
    fn a_gemini_table_configures_the_built_in_and_can_be_extended() {
        let (_dir, path) = file(
            "[providers.gemini]\ncommand = [\"/opt/gemini\"]\nenv = { GEMINI_API_KEY = \"k\" }\n\
             [providers.gemini-gateway]\nextends = \"gemini\"\nlabel = \"Gemini via gateway\"\n",
        );
        let s = Settings::load_from(Some(&path), &[]).unwrap();
        assert_eq!(
            s.providers["gemini"].command.as_deref(),
            Some(&["/opt/gemini".to_owned()][..])
        );
        assert_eq!(
            s.providers["gemini-gateway"].extends.as_deref(),
            Some("gemini")
        );
        let e = refused("[providers.gemini]\nextends = \"acp\"\n", &[]);
        assert_eq!(e.setting, "providers.gemini.extends");
    }

    #[test]
    fn team_secrets_are_environment_variable_names_a_provider_takes() {
        let (_dir, path) = file(
            "[providers.claude]\nteam_secrets = [\"ANTHROPIC_API_KEY\"]\n\
             [providers.my-agent]\nextends = \"acp\"\nteam_secrets = [\"A_1\", \"_B\"]\n",
        );
        let s = Settings::load_from(Some(&path), &[]).unwrap();
        assert_eq!(s.providers["claude"].team_secrets, ["ANTHROPIC_API_KEY"]);
        assert_eq!(s.providers["my-agent"].team_secrets, ["A_1", "_B"]);
        let s = Settings::load_from(
            None,
            &env(&[(
                "AGENTRY_PROVIDERS__CODEX__TEAM_SECRETS",
                "[\"OPENAI_API_KEY\"]",
            )]),
        )
        .unwrap();
        assert_eq!(s.providers["codex"].team_secrets, ["OPENAI_API_KEY"]);

        for bad in ["\"lower\"", "\"1A\"", "\"A-B\"", "\"\""] {
            let e = refused(
                &format!("[providers.claude]\nteam_secrets = [{bad}]\n"),
                &[],
            );
            assert_eq!(e.setting, "providers.claude.team_secrets", "{e}");
        }
        let e = refused("[providers.claude]\nteam_secrets = [\"K\", \"K\"]\n", &[]);
        assert!(e.message.contains("twice"), "{e}");
        let e = refused(
            "[providers.claude]\nteam_secrets = [\"K\"]\nenv = { K = \"v\" }\n",
            &[],
        );
        assert_eq!(e.setting, "providers.claude.team_secrets");
        // The built-in mock takes no credentials.
        let e = refused("[providers.mock]\nteam_secrets = [\"K\"]\n", &[]);
        assert_eq!(e.setting, "providers.mock.team_secrets");
    }

    #[test]
    fn secrets_keys_are_32_bytes_of_base64_and_redacted() {
        let key = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
        let s = Settings::load_from(
            None,
            &env(&[
                ("AGENTRY_SECRETS__KEY", key),
                ("AGENTRY_SECRETS__PREVIOUS_KEYS", &format!("[\"{key}\"]")),
            ]),
        )
        .unwrap();
        assert_eq!(s.secrets.key.as_ref().unwrap().expose(), key);
        assert_eq!(s.secrets.previous_keys.len(), 1);
        assert!(
            !format!("{s:?}").contains(key),
            "keys are redacted in Debug"
        );
        assert_eq!(
            decode_secrets_key(&Secret::new(key)).unwrap(),
            std::array::from_fn::<u8, 32, _>(|i| i as u8)
        );

        let e = refused("[secrets]\nkey = \"c2hvcnQ=\"\n", &[]);
        assert_eq!(e.setting, "secrets.key");
        assert!(e.message.contains("32"), "{e}");
        let e = refused("[secrets]\nkey = \"not base64!\"\n", &[]);
        assert_eq!(e.setting, "secrets.key");
        let e = refused(
            &format!("[secrets]\nkey = \"{key}\"\nprevious_keys = [\"{key}\", \"x\"]\n"),
            &[],
        );
        assert_eq!(e.setting, "secrets.previous_keys[1]");
        let e = refused("[secrets]\nkeys = []\n", &[]);
        assert_eq!(e.setting, "secrets.keys");
    }

    #[test]
    fn client_and_test_variables_are_not_settings() {
        let s = Settings::load_from(
            None,
            &env(&[
                ("AGENTRY_URL", "http://127.0.0.1:8080"),
                ("AGENTRY_TOKEN", "agt_pat_x"),
                ("AGENTRY_TEST_SEED", "42"),
                ("AGENTRY_CONFIG", "/nowhere.toml"),
            ]),
        )
        .unwrap();
        assert_eq!(s.listen, "127.0.0.1:8080");
    }
}
