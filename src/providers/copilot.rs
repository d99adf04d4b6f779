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
use super::adapter::*;
use super::broker::{BrokerSpec, Credential, KeyHeader, KeyVar};
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
        // Only a model provider of one's own (BYOK) of the OpenAI kind: GitHub's own
        // models are reached with the GitHub token, which the CLI itself exchanges.
        credential: Credential::Brokerable(BrokerSpec {
            prefix: "copilot-provider",
            base_url_var: BYOK_VAR,
            default_upstream: None,
            keys: &[
                KeyVar {
                    var: "COPILOT_PROVIDER_API_KEY",
                    header: KeyHeader::Bearer,
                },
                KeyVar {
                    var: "COPILOT_PROVIDER_BEARER_TOKEN",
                    header: KeyHeader::Bearer,
                },
            ],
            not_with: &[],
            only_when: Some(("COPILOT_PROVIDER_TYPE", &["openai"])),
        }),
        modes: MODES,
        default_mode: "agent",
        build: |cfg| Arc::new(CopilotProvider::new(cfg)),
    }
}

#[rustfmt::skip]
const MODES: &[ModeRow] = &[
    ("agent", "Agent", "Asks before it runs tools, touches paths outside the workspace or fetches URLs", false),
    ("plan", "Plan", "Plans multi-step work before acting; asks like agent", false),
    ("allow-all", "Allow all", "Agent mode that approves every tool, path and URL itself and never asks", true),
    ("autopilot", "Autopilot", "Never asks and keeps going until the task is done (experimental in Copilot)", true),
];

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

    async fn start(&self, spec: SessionSpec, launcher: Launcher, events: EventSink) -> Started {
        self.acp.start(spec, launcher, events).await
    }
}

#[cfg(test)]
mod tests {
    //! Copilot's recorded transcript (`tests/fixtures/copilot`, captured from Copilot
    //! 1.0.102 against the fake model server) replayed by a `sh` agent through the
    //! provider: modes read and set through the presets, a denied `create`.

    use std::collections::BTreeMap;
    use std::time::Duration;

    use serde_json::json;
    use tokio::sync::mpsc;

    use super::*;
    use crate::domain::{Behavior, ToolKind, ToolStatus, TurnOutcome};
    use crate::process::{CommandSpec, ManagedChild, ProcessError};
    use crate::providers::test_support::assert_allow_always_deny;
    use crate::providers::{PermissionDecision, ProviderEvent, TurnInput};

    struct Spawn;

    #[async_trait]
    impl ProcessLauncher for Spawn {
        async fn launch(&self, spec: CommandSpec) -> Result<ManagedChild, ProcessError> {
            crate::process::spawn(&spec)
        }
    }

    /// Answers each request with the recorded lines of that step; a `set_config_option`
    /// other than `allow_all` = `on` is refused, so a wrong request fails the test.
    const REPLAY: &str = r#"
play() { sed "s/\"__ID__\"/$id/" "$FIXTURES/$1"; }
while IFS= read -r line; do
  id=$(printf '%s' "$line" | sed -n -e 's/.*"id":\([0-9][0-9]*\).*/\1/p' -e 's/.*"id":\("[^"]*"\).*/\1/p')
  case "$line" in
  *'"method":"initialize"'*) play initialize.jsonl ;;
  *'"method":"session/new"'*) play session_new.jsonl ;;
  *'"method":"session/set_config_option"'*)
    case "$line" in
    *'"configId":"allow_all","value":"on"'*) play allow_all_on.jsonl ;;
    *) printf '{"jsonrpc":"2.0","id":%s,"error":{"code":-32602,"message":"unexpected %s"}}\n' "$id" "$(printf '%s' "$line" | tr -d '"\\')" ;;
    esac ;;
  *'"method":"session/prompt"'*)
    prompt=$id
    play prompt_create.jsonl
    IFS= read -r answer
    case "$answer" in
    *'"optionId":"reject_once"'*) id=$prompt; play prompt_create_denied.jsonl ;;
    *) printf '{"jsonrpc":"2.0","id":%s,"error":{"code":-32603,"message":"not recorded"}}\n' "$prompt" ;;
    esac ;;
  *'"method":'*) printf '{"jsonrpc":"2.0","id":%s,"error":{"code":-32601,"message":"Method not found"}}\n' "$id" ;;
  esac
done
"#;

    fn replaying() -> CopilotProvider {
        let fixtures = format!("{}/tests/fixtures/copilot", env!("CARGO_MANIFEST_DIR"));
        let mut cfg = crate::providers::registry::builtin_config(&builtin(), "copilot", None);
        cfg.command = vec!["sh".into(), "-c".into(), REPLAY.into()];
        cfg.env = BTreeMap::from([("FIXTURES".to_owned(), fixtures)]);
        CopilotProvider::new(cfg)
    }

    async fn next(rx: &mut mpsc::Receiver<ProviderEvent>) -> ProviderEvent {
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("an event in time")
            .expect("the session is still open")
    }

    #[tokio::test]
    async fn copilot_modes_and_a_denied_create_map_from_its_transcript() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, mut rx) = mpsc::channel(256);
        let spec = SessionSpec {
            cwd: dir.path().to_path_buf(),
            model: None,
            mode: Some("agent".into()),
            system_prompt: None,
            mcp_servers: BTreeMap::new(),
            resume: None,
        };
        let (mut session, info) = replaying()
            .start(spec, Arc::new(Spawn), tx)
            .await
            .expect("the replay starts");
        // Copilot's `…#agent` with `allow_all` off is agentry's `agent`: nothing to set.
        assert_eq!(info.current_mode.as_deref(), Some("agent"));
        assert_eq!(
            info.provider_session_id.as_deref(),
            Some("28eeb367-ef45-4458-9b18-015aa4979b37")
        );

        session
            .prompt(TurnInput {
                text: "write hello.txt".into(),
            })
            .await
            .unwrap();
        let mut tools = Vec::new();
        let mut texts = Vec::new();
        let (outcome, usage) = loop {
            match next(&mut rx).await {
                ProviderEvent::ToolCall(call) => tools.push(call),
                ProviderEvent::PermissionRequested(request) => {
                    assert_allow_always_deny(&request.options);
                    assert_eq!(request.call_id.as_deref(), Some("call_1"));
                    assert_eq!(request.title, "Create file");
                    request
                        .reply
                        .send(PermissionDecision::Selected {
                            option_id: "deny".into(),
                            behavior: Behavior::Deny,
                            message: None,
                            updated_input: None,
                        })
                        .unwrap();
                }
                ProviderEvent::AssistantDelta { text, .. } => texts.push(text),
                ProviderEvent::TurnEnded { outcome, usage, .. } => break (outcome, usage),
                ProviderEvent::Usage(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        };
        assert_eq!(outcome, TurnOutcome::Completed);
        let pending = &tools[0];
        assert_eq!(pending.status, ToolStatus::Pending);
        assert_eq!(pending.tool_kind, ToolKind::Edit);
        assert_eq!(
            pending.input,
            json!({"path": "/tmp/tmpuxydzf0p/hello.txt", "file_text": "hello from copilot\n"})
        );
        assert_eq!(
            pending.diff[0].new_text.as_deref(),
            Some("hello from copilot\n")
        );
        let failed = tools.last().unwrap();
        assert_eq!(failed.status, ToolStatus::Failed);
        // The request's `{fileName, diff}` did not replace the call's own arguments.
        assert_eq!(failed.input, pending.input);
        assert_eq!(
            failed.error.as_deref(),
            Some("The user rejected this tool call.")
        );
        // Copilot's own note on the refusal arrives as assistant text.
        assert_eq!(texts, ["Info: Operation cancelled by user"]);
        let usage = usage.expect("usage with the answer");
        assert_eq!((usage.input_tokens, usage.output_tokens), (30, 7));

        // `allow-all` is `allow_all` = `on` (the replay refuses anything else), reported
        // once although Copilot both answers and notifies.
        session
            .set_mode("allow-all")
            .await
            .expect("allow-all is set");
        match next(&mut rx).await {
            ProviderEvent::ModeChanged { mode } => assert_eq!(mode, "allow-all"),
            other => panic!("expected the mode change, got {other:?}"),
        }
        // A mode no preset has goes to the agent as it is (`session/set_mode`), and an
        // agent that does not know it refuses it.
        assert!(session.set_mode("yolo").await.is_err());
        session.close().await;
    }

    #[test]
    fn only_the_npm_launcher_is_replaced_by_the_platform_binary() {
        assert_eq!(native_binary("sh"), None);
        assert_eq!(native_binary("/nonexistent/copilot"), None);
        let scope = tempfile::tempdir().unwrap();
        let loader = scope.path().join("copilot/npm-loader.js");
        let arch = match std::env::consts::ARCH {
            "x86_64" => "x64",
            "aarch64" => "arm64",
            other => other,
        };
        let native = scope.path().join(format!("copilot-linux-{arch}/copilot"));
        for (file, _) in [(&loader, ()), (&native, ())] {
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(file, "#!/bin/sh\n").unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let link = scope.path().join("bin/copilot");
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&loader, &link).unwrap();
        let found = native_binary(link.to_str().unwrap()).expect("the platform binary");
        assert_eq!(found, std::fs::canonicalize(&native).unwrap());
    }
}
