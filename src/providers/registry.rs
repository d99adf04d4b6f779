//! The providers a server offers, by id, built from the settings at start: `mock`, the
//! built-in CLI providers (`builtins()`) adjusted by their `[providers.<id>]` tables, one
//! more profile per table with `extends = "<built-in id>"`, and one ACP provider per table
//! with `extends = "acp"`.
//!
//! One merge rule for every built-in: `command` replaces the program (and may add
//! arguments), `args` append after the adapter's own flags, `env` merges over the
//! defaults, `label`/`modes`/`default_mode` override, and `enabled = false` hides it.
//! `team_secrets` names variables each team supplies; the registry keeps them by id.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use crate::config::ProviderSettings;

use super::acp::{AcpProvider, AcpProviderConfig};
use super::mock::mock_provider;
use super::{Builtin, CliConfig, ModeInfo, ModelInfo, Probe, Provider, ProviderError};

/// The CLI providers this server implements, by id.
pub fn builtins() -> Vec<Builtin> {
    vec![
        super::claude::builtin(),
        super::codex::builtin(),
        super::copilot::builtin(),
        super::gemini::builtin(),
        super::opencode::builtin(),
    ]
}

/// Why the registry could not be built from the settings.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("cannot find the agentry executable for the mock provider: {0}")]
    MockExecutable(#[source] std::io::Error),
}

/// The providers this server knows, by id, with the model catalog each one reported.
#[derive(Clone, Default)]
pub struct ProviderRegistry {
    providers: BTreeMap<String, Arc<dyn Provider>>,
    /// Catalogs by provider id, filled on first use and replaced by a refresh.
    catalogs: Arc<Mutex<HashMap<String, Arc<Vec<ModelInfo>>>>>,
    /// The `team_secrets` of each provider that takes any.
    team_secrets: BTreeMap<String, Vec<String>>,
}

impl ProviderRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// `mock` unless disabled (`<exe> mock-agent`, where `exe` is the first word of its
    /// `command`, else this executable), plus every enabled `extends = "acp"` table.
    pub fn from_settings(
        providers: &BTreeMap<String, ProviderSettings>,
    ) -> Result<Self, RegistryError> {
        let mut registry = Self::new();
        let mock = providers.get("mock");
        if mock.and_then(|p| p.enabled) != Some(false) {
            let exe = match mock
                .and_then(|p| p.command.as_ref())
                .and_then(|c| c.first())
            {
                Some(program) => program.into(),
                None => std::env::current_exe().map_err(RegistryError::MockExecutable)?,
            };
            registry.register(Arc::new(mock_provider(exe)));
        }
        let builtins = builtins();
        for b in &builtins {
            let own = providers.get(b.id);
            if own.and_then(|p| p.enabled) == Some(false) {
                continue;
            }
            let cfg = builtin_config(b, b.id, own);
            registry.register((b.build)(cfg));
            registry.set_team_secrets(b.id, own);
        }
        for (id, p) in providers {
            if p.enabled == Some(false) {
                continue;
            }
            match p.extends.as_deref() {
                Some("acp") => {
                    registry.register(Arc::new(AcpProvider::new(acp_config(id, p))));
                    registry.set_team_secrets(id, Some(p));
                }
                Some(base) => {
                    if let Some(b) = builtins.iter().find(|b| b.id == base) {
                        registry.register((b.build)(builtin_config(b, id, Some(p))));
                        registry.set_team_secrets(id, Some(p));
                    }
                }
                None => {}
            }
        }
        Ok(registry)
    }

    pub fn register(&mut self, provider: Arc<dyn Provider>) {
        let id = provider.info().id;
        self.catalogs.lock().expect("catalogs lock").remove(&id);
        self.providers.insert(id, provider);
    }

    fn set_team_secrets(&mut self, id: &str, p: Option<&ProviderSettings>) {
        match p.map(|p| &p.team_secrets).filter(|t| !t.is_empty()) {
            Some(names) => self.team_secrets.insert(id.to_owned(), names.clone()),
            None => self.team_secrets.remove(id),
        };
    }

    /// The variables provider `id` takes from each team's secrets (none for most).
    pub fn team_secrets(&self, id: &str) -> &[String] {
        self.team_secrets.get(id).map_or(&[], Vec::as_slice)
    }

    pub fn get(&self, id: &str) -> Option<Arc<dyn Provider>> {
        self.providers.get(id).cloned()
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<dyn Provider>> {
        self.providers.values()
    }

    /// The models of provider `id`: the cached catalog, or a fresh probe when nothing is
    /// cached or `refresh` is set (the probe's answer then replaces the cache; a failed
    /// probe leaves the cache as it was). `None` when no such provider exists.
    pub async fn models(
        &self,
        id: &str,
        refresh: bool,
        probe: &Probe,
    ) -> Option<Result<Arc<Vec<ModelInfo>>, ProviderError>> {
        let provider = self.get(id)?;
        if !refresh && let Some(cached) = self.catalogs.lock().expect("catalogs lock").get(id) {
            return Some(Ok(cached.clone()));
        }
        Some(provider.models(probe).await.map(|models| {
            let models = Arc::new(models);
            self.catalogs
                .lock()
                .expect("catalogs lock")
                .insert(id.to_owned(), models.clone());
            models
        }))
    }
}

/// A built-in's configuration under id `id`, with the table's settings merged in.
pub fn builtin_config(b: &Builtin, id: &str, p: Option<&ProviderSettings>) -> CliConfig {
    let mut cfg = CliConfig {
        id: id.to_owned(),
        label: b.label.to_owned(),
        command: vec![b.program.to_owned()],
        args: Vec::new(),
        env: b
            .env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        pass_env: b.pass_env.iter().map(|v| (*v).to_owned()).collect(),
        team_secrets: Vec::new(),
        modes: (b.modes)(),
        default_mode: Some(b.default_mode.to_owned()),
    };
    let Some(p) = p else { return cfg };
    if let Some(command) = &p.command {
        cfg.command = command.clone();
    }
    cfg.args = p.args.clone();
    cfg.env
        .extend(p.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    if let Some(label) = &p.label {
        cfg.label = label.clone();
    }
    if !p.modes.is_empty() {
        cfg.modes = modes(p);
    }
    if let Some(mode) = &p.default_mode {
        cfg.default_mode = Some(mode.clone());
    }
    cfg.team_secrets = p.team_secrets.clone();
    cfg
}

fn modes(p: &ProviderSettings) -> Vec<ModeInfo> {
    p.modes
        .iter()
        .map(|m| ModeInfo {
            id: m.id.clone(),
            label: m.label.clone().unwrap_or_else(|| m.id.clone()),
            description: m.description.clone(),
            unattended: m.unattended,
        })
        .collect()
}

/// The adapter configuration of an `extends = "acp"` table: its `command` (default: the
/// id) followed by its `args`.
fn acp_config(id: &str, p: &ProviderSettings) -> AcpProviderConfig {
    let mut command = p.command.clone().unwrap_or_else(|| vec![id.to_owned()]);
    command.extend(p.args.iter().cloned());
    AcpProviderConfig {
        id: id.to_owned(),
        label: p.label.clone().unwrap_or_else(|| id.to_owned()),
        command,
        env: p.env.clone(),
        pass_env: Vec::new(),
        modes: modes(p),
        default_mode: p.default_mode.clone(),
        models: Vec::new(),
        model_flag: None,
        serve_reads: true,
        auth_method: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(registry: &ProviderRegistry) -> Vec<String> {
        registry.all().map(|p| p.info().id).collect()
    }

    /// The built-in ids plus `more`, sorted like the registry.
    fn with_builtins(more: &[&str]) -> Vec<String> {
        let mut ids: Vec<String> = builtins().iter().map(|b| b.id.to_owned()).collect();
        ids.extend(more.iter().map(|id| (*id).to_owned()));
        ids.sort();
        ids
    }

    #[test]
    fn mock_is_offered_by_default() {
        let registry = ProviderRegistry::from_settings(&BTreeMap::new()).expect("registry");
        assert_eq!(ids(&registry), with_builtins(&["mock"]));
    }

    #[test]
    fn acp_tables_become_providers() {
        let toml = r#"
            [mock]
            enabled = false
            [inhouse]
            extends = "acp"
            command = ["inhouse-agent", "--experimental-acp"]
            args = ["--yolo"]
            label = "In-house agent"
            default_mode = "default"
            modes = [{ id = "default" }]
            [off]
            extends = "acp"
            enabled = false
        "#;
        let providers: BTreeMap<String, ProviderSettings> = toml::from_str(toml).expect("toml");
        let registry = ProviderRegistry::from_settings(&providers).expect("registry");
        assert_eq!(ids(&registry), with_builtins(&["inhouse"]));

        let config = acp_config("inhouse", &providers["inhouse"]);
        assert_eq!(
            config.command,
            ["inhouse-agent", "--experimental-acp", "--yolo"]
        );
        assert_eq!(config.label, "In-house agent");
        assert_eq!(config.modes.len(), 1);
        assert_eq!(config.modes[0].label, "default");
        assert_eq!(config.default_mode.as_deref(), Some("default"));

        let bare = acp_config("opencode", &ProviderSettings::default());
        assert_eq!(bare.command, ["opencode"]);
        assert_eq!(bare.label, "opencode");
    }

    #[test]
    fn descriptor_env_is_a_default_the_settings_override() {
        let claude = crate::providers::claude::builtin();
        let quiet = "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC";
        let plain = builtin_config(&claude, "claude", None);
        assert_eq!(plain.env.get(quiet).map(String::as_str), Some("1"));

        let settings = ProviderSettings {
            env: BTreeMap::from([
                (quiet.to_owned(), "0".to_owned()),
                (
                    "ANTHROPIC_BASE_URL".to_owned(),
                    "http://127.0.0.1:9".to_owned(),
                ),
            ]),
            ..ProviderSettings::default()
        };
        let merged = builtin_config(&claude, "claude", Some(&settings));
        assert_eq!(merged.env.get(quiet).map(String::as_str), Some("0"));
        assert_eq!(merged.env.len(), 2);
    }
}

#[cfg(test)]
mod catalog_tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use async_trait::async_trait;

    use super::*;
    use crate::providers::{
        Availability, EventSink, ProcessLauncher, ProviderCapabilities, ProviderInfo,
        ProviderSession, SessionInfo, SessionSpec,
    };

    /// A provider whose catalog source can change and that counts its probes.
    struct Catalog {
        source: Mutex<Vec<&'static str>>,
        probes: AtomicUsize,
    }

    #[async_trait]
    impl Provider for Catalog {
        fn info(&self) -> ProviderInfo {
            ProviderInfo {
                id: "cat".into(),
                label: "Catalog".into(),
                protocol: "test".into(),
                capabilities: ProviderCapabilities::default(),
                modes: Vec::new(),
                default_mode: None,
            }
        }
        async fn availability(&self) -> Availability {
            Availability::Available
        }
        async fn models(&self, _probe: &Probe) -> Result<Vec<ModelInfo>, ProviderError> {
            self.probes.fetch_add(1, Ordering::SeqCst);
            let source = self.source.lock().unwrap().clone();
            if source.is_empty() {
                return Err(ProviderError::Unavailable("the probe failed".into()));
            }
            Ok(source
                .into_iter()
                .map(|id| ModelInfo {
                    id: id.into(),
                    label: id.into(),
                    is_default: false,
                    context_window: None,
                })
                .collect())
        }
        async fn start(
            &self,
            _spec: SessionSpec,
            _launcher: Arc<dyn ProcessLauncher>,
            _events: EventSink,
        ) -> Result<(Box<dyn ProviderSession>, SessionInfo), ProviderError> {
            Err(ProviderError::Unsupported("sessions"))
        }
    }

    fn ids(models: &[ModelInfo]) -> Vec<&str> {
        models.iter().map(|m| m.id.as_str()).collect()
    }

    struct NoLaunch;

    #[async_trait]
    impl ProcessLauncher for NoLaunch {
        async fn launch(
            &self,
            spec: crate::process::CommandSpec,
        ) -> Result<crate::process::ManagedChild, crate::process::ProcessError> {
            Err(crate::process::ProcessError::NotFound(spec.program))
        }
    }

    #[tokio::test]
    async fn the_catalog_is_cached_and_a_refresh_replaces_it() {
        let probe = Probe {
            launcher: Arc::new(NoLaunch),
            cwd: std::env::temp_dir(),
        };
        let provider = Arc::new(Catalog {
            source: Mutex::new(vec!["a"]),
            probes: AtomicUsize::new(0),
        });
        let mut registry = ProviderRegistry::new();
        registry.register(provider.clone());
        assert!(registry.models("nope", false, &probe).await.is_none());

        let first = registry
            .models("cat", false, &probe)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ids(&first), ["a"]);
        *provider.source.lock().unwrap() = vec!["a", "b"];
        let cached = registry
            .models("cat", false, &probe)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ids(&cached), ["a"], "served from the cache");
        assert_eq!(provider.probes.load(Ordering::SeqCst), 1);

        let refreshed = registry.models("cat", true, &probe).await.unwrap().unwrap();
        assert_eq!(ids(&refreshed), ["a", "b"], "a refresh probes again");
        let after = registry
            .models("cat", false, &probe)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ids(&after), ["a", "b"], "and replaces the cached catalog");

        // A failed refresh reports the failure and keeps the last good catalog.
        provider.source.lock().unwrap().clear();
        assert!(registry.models("cat", true, &probe).await.unwrap().is_err());
        let kept = registry
            .models("cat", false, &probe)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ids(&kept), ["a", "b"]);
        assert_eq!(provider.probes.load(Ordering::SeqCst), 3);
    }
}
