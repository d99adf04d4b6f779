//! Gemini CLI, driven over ACP (`gemini --acp`) through the shared ACP adapter. What is
//! Gemini's own: its modes, its credentials, the flag that picks the model, a quiet
//! environment, and two quirks of its session store: the session cleanup it runs at
//! every start, turned off (see `SYSTEM_SETTINGS_VAR`), and the minute of creation (see
//! `resume_wait`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use serde_json::Value;

use super::acp::{AcpProvider, AcpProviderConfig};
use super::adapter::*;
use super::broker::{BrokerSpec, Credential, KeyHeader, KeyVar};

/// Variables that give Gemini CLI a credential (any one is enough).
const CREDENTIALS: [&str; 4] = [
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_GENAI_USE_VERTEXAI",
];

/// The variable naming Gemini CLI's system settings file, whose settings override the
/// user's and the workspace's.
///
/// Gemini CLI cleans up its session store at every start (`general.sessionRetention`, on
/// by default): it deletes each session file with no conversation in it together with
/// every other file of the same session. Reopening a session leaves such a file behind
/// (named after the minute of the reopening), so the start after a reopening deleted the
/// conversation itself, and conversations untouched for 30 days went too. agentry owns
/// when a conversation ends: it points this variable at a file of its own,
/// `<data_dir>/providers/<id>.system-settings.json`, that turns the cleanup off (and
/// otherwise holds the
/// system settings of `/etc/gemini-cli/settings.json`). An admin who sets the variable in
/// the provider's `env` keeps their file, and should turn the cleanup off in it.
pub const SYSTEM_SETTINGS_VAR: &str = "GEMINI_CLI_SYSTEM_SETTINGS_PATH";

/// Gemini CLI's own system settings file on Linux.
const HOST_SYSTEM_SETTINGS: &str = "/etc/gemini-cli/settings.json";

/// The built-in descriptor of `gemini`.
pub fn builtin() -> Builtin {
    Builtin {
        id: "gemini",
        label: "Gemini CLI",
        program: "gemini",
        pass_env: &[
            "GEMINI_API_KEY",
            "GOOGLE_API_KEY",
            "GOOGLE_GEMINI_BASE_URL",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "GOOGLE_CLOUD_PROJECT",
            "GOOGLE_CLOUD_LOCATION",
            "GOOGLE_GENAI_USE_VERTEXAI",
            "GEMINI_MODEL",
            "GEMINI_CLI_HOME",
        ],
        // It would otherwise relaunch itself as a child (with more heap), and stop at its
        // folder-trust prompt in a workspace it has not seen.
        env: &[
            ("GEMINI_CLI_NO_RELAUNCH", "true"),
            ("GEMINI_CLI_TRUST_WORKSPACE", "true"),
        ],
        credential: Credential::Brokerable(BrokerSpec {
            prefix: "gemini",
            base_url_var: "GOOGLE_GEMINI_BASE_URL",
            default_upstream: Some("https://generativelanguage.googleapis.com"),
            // Both name a Gemini API key (the second wins in the CLI's SDK when both are
            // set): both are withheld.
            keys: &[
                KeyVar {
                    var: "GOOGLE_API_KEY",
                    header: KeyHeader::Named("x-goog-api-key"),
                },
                KeyVar {
                    var: "GEMINI_API_KEY",
                    header: KeyHeader::Named("x-goog-api-key"),
                },
            ],
            not_with: &[(
                "GOOGLE_GENAI_USE_VERTEXAI",
                "Vertex AI uses the Google Cloud credentials, inside",
            )],
            only_when: None,
        }),
        modes: MODES,
        default_mode: "default",
        build: |cfg| Arc::new(GeminiProvider::new(cfg)),
    }
}

#[rustfmt::skip]
const MODES: &[ModeRow] = &[
    ("default", "Default", "Asks before editing files and running commands", false),
    ("autoEdit", "Auto edit", "Edits files without asking; asks before running commands", false),
    ("plan", "Plan", "Reads and plans only; changes nothing", false),
    ("yolo", "YOLO", "Runs every tool without asking", true),
];

/// The models Gemini CLI 0.61.0 offers (its `session/new` answer lists the same). `auto`
/// lets the CLI choose per request, which is what it does when no model is given.
fn models() -> Vec<ModelInfo> {
    [
        ("auto", "Auto (the CLI chooses)", true, None),
        ("gemini-2.5-pro", "Gemini 2.5 Pro", false, Some(1_048_576)),
        (
            "gemini-2.5-flash",
            "Gemini 2.5 Flash",
            false,
            Some(1_048_576),
        ),
        (
            "gemini-2.5-flash-lite",
            "Gemini 2.5 Flash-Lite",
            false,
            Some(1_048_576),
        ),
    ]
    .into_iter()
    .map(|(id, label, is_default, context_window)| ModelInfo {
        id: id.to_owned(),
        label: label.to_owned(),
        is_default,
        context_window,
    })
    .collect()
}

/// Gemini CLI as a provider: the ACP adapter with Gemini's settings.
pub struct GeminiProvider {
    cfg: CliConfig,
    acp: AcpProvider,
    /// The system settings file agentry writes for the CLI (see `SYSTEM_SETTINGS_VAR`);
    /// `None` when the settings name one.
    system_settings: Option<PathBuf>,
}

impl GeminiProvider {
    pub fn new(cfg: CliConfig) -> Self {
        let mut acp = AcpProviderConfig::from_cli(cfg.clone(), &["--acp"]);
        acp.model_flag = Some("--model".to_owned());
        // Gemini 0.61.0 reads a client's error answer as "[object Object]", so a missing
        // file read through the client fails its write tool instead of creating the
        // file: it reads by itself, and its writes still come to the workspace-confined
        // `fs/write_text_file`.
        acp.serve_reads = false;
        acp.models = models();
        // Without a gateway and without an auth type chosen in its settings, Gemini opens
        // new sessions on the key it finds but refuses to reopen one until told which
        // credential to use.
        acp.auth_method = auth_method(&cfg).map(str::to_owned);
        // Beside the provider's state directory, not in it: that directory is mounted
        // read-write into every agent's sandbox, this file only read-only (see
        // `sandbox::SETTINGS_FILE_VARS`).
        let system_settings = (!cfg.var_is_set(SYSTEM_SETTINGS_VAR)).then(|| {
            cfg.state_dir
                .clone()
                .unwrap_or_else(|| std::env::temp_dir().join("agentry-gemini").join(&cfg.id))
                .with_file_name(format!("{}.system-settings.json", cfg.id))
        });
        if let Some(file) = &system_settings {
            acp.env
                .insert(SYSTEM_SETTINGS_VAR.to_owned(), file.display().to_string());
        }
        Self {
            cfg,
            acp: AcpProvider::new(acp),
            system_settings,
        }
    }
}

/// `base` (the host's system settings, when any) with Gemini's session cleanup off.
pub fn system_settings(base: Option<Value>) -> Value {
    let mut settings = match base {
        Some(Value::Object(map)) => Value::Object(map),
        _ => Value::Object(Default::default()),
    };
    let general = settings
        .as_object_mut()
        .expect("an object")
        .entry("general")
        .or_insert_with(|| Value::Object(Default::default()));
    if !general.is_object() {
        *general = Value::Object(Default::default());
    }
    let retention = general
        .as_object_mut()
        .expect("an object")
        .entry("sessionRetention")
        .or_insert_with(|| Value::Object(Default::default()));
    if !retention.is_object() {
        *retention = Value::Object(Default::default());
    }
    retention
        .as_object_mut()
        .expect("an object")
        .insert("enabled".to_owned(), Value::Bool(false));
    settings
}

/// Write the system settings file at `path` (when it does not hold them already).
fn write_system_settings(path: &Path) -> Result<(), ProviderError> {
    let base = match std::fs::read_to_string(HOST_SYSTEM_SETTINGS) {
        Ok(text) => match serde_json::from_str::<Value>(&text) {
            Ok(value) => Some(value),
            Err(e) => {
                tracing::warn!(file = HOST_SYSTEM_SETTINGS, error = %e, "Gemini's system settings are not plain JSON; the CLI runs without them");
                None
            }
        },
        Err(_) => None,
    };
    let text = serde_json::to_string_pretty(&system_settings(base)).expect("JSON");
    if std::fs::read_to_string(path).ok().as_deref() == Some(text.as_str()) {
        return Ok(());
    }
    let failed = |e: std::io::Error| {
        ProviderError::Unavailable(format!("cannot write {}: {e}", path.display()))
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(failed)?;
    }
    // Whole or not at all: a CLI starting meanwhile reads the old file or the new one.
    let tmp = path.with_extension(format!("tmp{}", uuid::Uuid::now_v7().simple()));
    std::fs::write(&tmp, text).map_err(failed)?;
    std::fs::rename(&tmp, path).map_err(failed)
}

#[async_trait]
impl Provider for GeminiProvider {
    fn info(&self) -> ProviderInfo {
        self.acp.info()
    }

    async fn availability(&self) -> Availability {
        if let Availability::Unavailable(why) = self.acp.availability().await {
            return Availability::Unavailable(why);
        }
        if CREDENTIALS.iter().any(|name| self.cfg.var_is_set(name)) {
            return Availability::Available;
        }
        Availability::Unavailable(format!(
            "no Gemini credentials: set one of {} (in the server's environment, the \
             provider's `env`, or as a team secret named in `team_secrets`)",
            CREDENTIALS.join(", ")
        ))
    }

    async fn models(&self, probe: &Probe) -> Result<Vec<ModelInfo>, ProviderError> {
        self.acp.models(probe).await
    }

    async fn start(&self, spec: SessionSpec, launcher: Launcher, events: EventSink) -> Started {
        let created = spec
            .resume
            .as_ref()
            .and_then(|handle| handle.get("created_at"))
            .and_then(Value::as_u64);
        if let Some(created) = created
            && let Some(wait) = resume_wait(created, now_secs())
        {
            tracing::info!(
                wait_ms = wait.as_millis() as u64,
                "waiting for the minute the Gemini session was created in to pass"
            );
            tokio::time::sleep(wait).await;
        }
        if let Some(file) = &self.system_settings {
            write_system_settings(file)?;
        }
        let (session, mut info) = self.acp.start(spec, launcher, events).await?;
        // Keep when the conversation was created (a resume keeps the first time).
        let created_at = if info.resumed {
            created.unwrap_or_else(now_secs)
        } else {
            now_secs()
        };
        if let Some(Value::Object(handle)) = info.persistence.as_mut() {
            handle.insert("created_at".to_owned(), Value::from(created_at));
        }
        Ok((session, info))
    }
}

/// The `authenticate` method matching the credential the child will have, if any.
fn auth_method(cfg: &CliConfig) -> Option<&'static str> {
    if cfg.var_is_set("GEMINI_API_KEY") || cfg.var_is_set("GOOGLE_API_KEY") {
        Some("gemini-api-key")
    } else if cfg.var_is_set("GOOGLE_GENAI_USE_VERTEXAI")
        || cfg.var_is_set("GOOGLE_APPLICATION_CREDENTIALS")
    {
        Some("vertex-ai")
    } else {
        None
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// How long to wait before reopening a session created at `created` (Unix seconds),
/// `now` being the current time. Gemini CLI names a conversation's file after the UTC
/// minute it started in and opens a fresh file of that name whenever a session starts;
/// a `session/load` within the minute of creation therefore finds the conversation
/// emptied and fails. Waiting until that minute is over keeps the history.
pub fn resume_wait(created: u64, now: u64) -> Option<Duration> {
    if created / 60 != now / 60 {
        return None;
    }
    // Up to a second past the turn of the minute, for clocks that disagree slightly.
    let next = (created / 60 + 1) * 60;
    Some(Duration::from_secs(next - now + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_in_the_minute_of_creation_waits_for_the_next_one() {
        assert_eq!(resume_wait(120, 120), Some(Duration::from_secs(61)));
        assert_eq!(resume_wait(120, 179), Some(Duration::from_secs(2)));
        assert_eq!(resume_wait(119, 120), None);
        assert_eq!(resume_wait(120, 300), None);
    }

    #[test]
    fn the_system_settings_turn_the_session_cleanup_off_and_keep_the_rest() {
        let fresh = system_settings(None);
        assert_eq!(
            fresh,
            serde_json::json!({"general": {"sessionRetention": {"enabled": false}}})
        );
        let kept = system_settings(Some(serde_json::json!({
            "general": {"sessionRetention": {"enabled": true, "maxAge": "7d"}, "vimMode": true},
            "privacy": {"usageStatisticsEnabled": false}
        })));
        assert_eq!(
            kept,
            serde_json::json!({
                "general": {"sessionRetention": {"enabled": false, "maxAge": "7d"}, "vimMode": true},
                "privacy": {"usageStatisticsEnabled": false}
            })
        );
        assert_eq!(
            system_settings(Some(serde_json::json!({"general": 3}))),
            fresh
        );
    }

    #[test]
    fn credentials_decide_availability() {
        let cfg = |env: &[(&str, &str)]| CliConfig {
            id: "gemini".into(),
            label: "Gemini CLI".into(),
            command: vec!["sh".into()],
            args: Vec::new(),
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            pass_env: Vec::new(),
            team_secrets: Vec::new(),
            state_dir: None,
            modes: crate::providers::modes_of(MODES),
            default_mode: Some("default".into()),
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let without = runtime.block_on(GeminiProvider::new(cfg(&[])).availability());
        match without {
            Availability::Unavailable(why) => assert!(why.contains("GEMINI_API_KEY"), "{why}"),
            Availability::Available => panic!("available without a credential"),
        }
        let with =
            runtime.block_on(GeminiProvider::new(cfg(&[("GEMINI_API_KEY", "k")])).availability());
        assert!(matches!(with, Availability::Available));
        let mut secret = cfg(&[]);
        secret.team_secrets = vec!["GEMINI_API_KEY".into()];
        let by_secret = runtime.block_on(GeminiProvider::new(secret).availability());
        assert!(matches!(by_secret, Availability::Available));
    }
}
