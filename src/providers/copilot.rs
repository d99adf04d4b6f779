//! The `copilot` provider: GitHub Copilot CLI (`copilot --acp`) through the generic ACP
//! adapter. What is Copilot's own is here: its descriptor, when it can be used (a GitHub
//! token, or a model provider of the team's own — "BYOK"), and its modes, which are two
//! of its config options at once (see `acp::ModePreset`):
//!
//! | agentry mode | Copilot `mode` | Copilot `allow_all` | asks |
//! |---|---|---|---|
//! | `agent` | `…#agent` | `off` | before tools, paths and URLs |
//! | `plan` | `…#plan` | `off` | the same, and plans before it acts |
//! | `allow-all` | `…#agent` | `on` | never |
//! | `autopilot` | `…#autopilot` | `on` | never, and continues until the task is done |
//!
//! Copilot's mode values are URLs (`https://agentclientprotocol.com/protocol/
//! session-modes#agent`); the adapter takes them from the options Copilot offers and
//! matches them by their fragment.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;

use super::acp::{AcpProvider, AcpProviderConfig, ModePreset};
use super::{
    Availability, Builtin, CliConfig, EventSink, ModeInfo, ModelInfo, Probe, ProcessLauncher,
    Provider, ProviderError, ProviderInfo, ProviderSession, SessionInfo, SessionSpec, mode,
};
use crate::process::{find_executable, is_executable};

/// ACP on stdio, and no usage reports from the CLI itself.
const PROTOCOL_ARGS: &[&str] = &["--acp", "--disable-client-telemetry"];

/// Variables that sign Copilot in, in its order of precedence.
const TOKEN_VARS: &[&str] = &["COPILOT_GITHUB_TOKEN", "GH_TOKEN", "GITHUB_TOKEN"];
/// The variable that points Copilot at a model provider of one's own.
const BYOK_VAR: &str = "COPILOT_PROVIDER_BASE_URL";

const PASS_ENV: &[&str] = &[
    "COPILOT_GITHUB_TOKEN",
    "GH_TOKEN",
    "GITHUB_TOKEN",
    "GH_HOST",
    "COPILOT_GH_HOST",
    "COPILOT_HOME",
    "COPILOT_MODEL",
    "COPILOT_OFFLINE",
    "COPILOT_PROVIDER_BASE_URL",
    "COPILOT_PROVIDER_TYPE",
    "COPILOT_PROVIDER_API_KEY",
    "COPILOT_PROVIDER_BEARER_TOKEN",
    "COPILOT_PROVIDER_WIRE_API",
    "COPILOT_PROVIDER_MODEL_ID",
    "COPILOT_PROVIDER_WIRE_MODEL",
    "COPILOT_PROVIDER_HEADERS",
    "COPILOT_PROVIDER_AZURE_API_VERSION",
    "COPILOT_PROVIDER_MAX_PROMPT_TOKENS",
    "COPILOT_PROVIDER_MAX_OUTPUT_TOKENS",
];

/// The built-in descriptor.
pub fn builtin() -> Builtin {
    Builtin {
        id: "copilot",
        label: "GitHub Copilot CLI",
        program: "copilot",
        pass_env: PASS_ENV,
        // A server's CLI does not replace itself with a newer download. (`COPILOT_OFFLINE`
        // stops every other outside call but also GitHub sign-in, so it is left to the
        // settings: a BYOK setup sets it.)
        env: &[("COPILOT_AUTO_UPDATE", "false")],
        modes,
        default_mode: "agent",
        build: |cfg| Arc::new(CopilotProvider::new(cfg)),
    }
}

fn modes() -> Vec<ModeInfo> {
    vec![
        mode(
            "agent",
            "Agent",
            "Asks before it runs tools, touches paths outside the workspace or fetches URLs",
            false,
        ),
        mode(
            "plan",
            "Plan",
            "Plans multi-step work before acting; asks like agent",
            false,
        ),
        mode(
            "allow-all",
            "Allow all",
            "Agent mode that approves every tool, path and URL itself and never asks",
            true,
        ),
        mode(
            "autopilot",
            "Autopilot",
            "Never asks and keeps going until the task is done (experimental in Copilot)",
            true,
        ),
    ]
}

/// How each agentry mode is set on Copilot's `mode` and `allow_all` options.
pub fn mode_presets() -> Vec<ModePreset> {
    vec![
        ModePreset::new("agent", &[("mode", "agent"), ("allow_all", "off")]),
        ModePreset::new("plan", &[("mode", "plan"), ("allow_all", "off")]),
        ModePreset::new("allow-all", &[("mode", "agent"), ("allow_all", "on")]),
        ModePreset::new("autopilot", &[("mode", "autopilot"), ("allow_all", "on")]),
    ]
}

/// The Copilot CLI over ACP, with its own availability rule.
pub struct CopilotProvider {
    cfg: CliConfig,
    acp: AcpProvider,
}

impl CopilotProvider {
    pub fn new(cfg: CliConfig) -> Self {
        let mut run = cfg.clone();
        if let Some(native) = run.command.first().and_then(|p| native_binary(p)) {
            run.command[0] = native.display().to_string();
        }
        let acp = AcpProvider::new(AcpProviderConfig::from_cli(run, PROTOCOL_ARGS))
            .with_mode_presets(mode_presets());
        Self { cfg, acp }
    }
}

/// The platform binary that `program` starts, when `program` is the npm package's
/// launcher (`@github/copilot/npm-loader.js`, a node script that runs
/// `@github/copilot-<platform>-<arch>/copilot` with the same arguments and stdio). Run
/// directly, the process agentry supervises is the CLI itself: a signal reaches it, and
/// no orphan keeps the pipes open when the launcher alone dies.
fn native_binary(program: &str) -> Option<PathBuf> {
    let launcher = std::fs::canonicalize(find_executable(program)?).ok()?;
    if launcher.file_name()? != "npm-loader.js" {
        return None;
    }
    let scope = launcher.parent()?.parent()?;
    let arch = match std::env::consts::ARCH {
        "x86_64" => "x64",
        "aarch64" => "arm64",
        other => other,
    };
    ["linux", "linuxmusl"]
        .iter()
        .map(|platform| scope.join(format!("copilot-{platform}-{arch}/copilot")))
        .find(|candidate| is_executable(candidate))
}

#[async_trait]
impl Provider for CopilotProvider {
    fn info(&self) -> ProviderInfo {
        self.acp.info()
    }

    async fn availability(&self) -> Availability {
        if let Availability::Unavailable(why) = self.acp.availability().await {
            return Availability::Unavailable(why);
        }
        let set = |name: &str| self.cfg.var_is_set(name);
        if TOKEN_VARS.iter().any(|v| set(v)) || set(BYOK_VAR) {
            return Availability::Available;
        }
        Availability::Unavailable(format!(
            "no Copilot credentials: set a GitHub token ({}) or a model provider of your own \
             ({BYOK_VAR}, with COPILOT_PROVIDER_API_KEY and COPILOT_MODEL), in the server's \
             environment or the provider's `env`",
            TOKEN_VARS.join(", ")
        ))
    }

    /// The model a BYOK setup names (`COPILOT_MODEL`); Copilot's own catalog is not probed.
    async fn models(&self, probe: &Probe) -> Result<Vec<ModelInfo>, ProviderError> {
        match self
            .cfg
            .child_var("COPILOT_MODEL")
            .filter(|m| !m.is_empty())
        {
            Some(model) => Ok(vec![ModelInfo {
                label: model.clone(),
                id: model,
                is_default: true,
                context_window: None,
            }]),
            None => self.acp.models(probe).await,
        }
    }

    async fn start(
        &self,
        spec: SessionSpec,
        launcher: Arc<dyn ProcessLauncher>,
        events: EventSink,
    ) -> Result<(Box<dyn ProviderSession>, SessionInfo), ProviderError> {
        self.acp.start(spec, launcher, events).await
    }
}
