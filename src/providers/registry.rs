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
use std::path::Path;
use std::sync::{Arc, Mutex};

use tokio::sync::OnceCell;

use crate::config::{BuiltInCli, ProviderSettings};
use crate::domain::SecretEnv;

use super::acp::{AcpProvider, AcpProviderConfig};
use super::broker::{BrokerInput, Brokering, Credential};
use super::mock::mock_provider;
use super::{Builtin, CatalogScope, CliConfig, ModeInfo, ModelInfo, Probe, Provider, modes_of};

/// The CLI providers this server implements, by id: one per `BuiltInCli`, the list the
/// settings check their `[providers.<id>]` tables against.
pub fn builtins() -> Vec<Builtin> {
    BuiltInCli::ALL.into_iter().map(builtin).collect()
}

/// The adapter of one built-in; the match makes a new `BuiltInCli` need one.
fn builtin(b: BuiltInCli) -> Builtin {
    match b {
        BuiltInCli::Claude => super::claude::builtin(),
        BuiltInCli::Codex => super::codex::builtin(),
        BuiltInCli::Copilot => super::copilot::builtin(),
        BuiltInCli::Gemini => super::gemini::builtin(),
        BuiltInCli::OpenCode => super::opencode::builtin(),
        BuiltInCli::Pi => super::pi::builtin(),
    }
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
    /// Catalogs by provider id and scope, filled on first use (one probe however many ask
    /// at once) and replaced by a refresh.
    catalogs: Arc<Mutex<HashMap<(String, CatalogScope), Slot>>>,
    /// The `team_secrets` of each provider that takes any.
    team_secrets: BTreeMap<String, Vec<String>>,
    /// What decides where each built-in CLI's credential is (see `brokering`).
    credentials: BTreeMap<String, CredentialSource>,
}

/// A built-in's credential description with the configuration its CLI runs with.
#[derive(Clone)]
struct CredentialSource {
    credential: Credential,
    env: BTreeMap<String, String>,
    pass_env: Vec<String>,
    args: Vec<String>,
}

impl CredentialSource {
    fn of(b: &Builtin, cfg: &CliConfig) -> Self {
        Self {
            credential: b.credential,
            env: cfg.env.clone(),
            pass_env: cfg.pass_env.clone(),
            args: cfg.args.clone(),
        }
    }
}

impl ProviderRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// `mock` unless disabled (`agentry-mock` beside `exe`, else `<exe> mock-agent`, where
    /// `exe` is the first word of its `command`, else this executable), plus every enabled
    /// `extends = "acp"` table.
    pub fn from_settings(
        providers: &BTreeMap<String, ProviderSettings>,
    ) -> Result<Self, RegistryError> {
        Self::from_settings_in(providers, None)
    }

    /// `from_settings`, with each CLI provider's `state_dir` at
    /// `<data_dir>/providers/<id>`.
    pub fn from_settings_in(
        providers: &BTreeMap<String, ProviderSettings>,
        data_dir: Option<&Path>,
    ) -> Result<Self, RegistryError> {
        let state_dir = |id: &str| data_dir.map(|d| d.join("providers").join(id));
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
            let mut cfg = builtin_config(b, b.id, own);
            cfg.state_dir = state_dir(b.id);
            registry
                .credentials
                .insert(b.id.to_owned(), CredentialSource::of(b, &cfg));
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
                        let mut cfg = builtin_config(b, id, Some(p));
                        cfg.state_dir = state_dir(id);
                        registry
                            .credentials
                            .insert(id.to_owned(), CredentialSource::of(b, &cfg));
                        registry.register((b.build)(cfg));
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
        self.catalogs
            .lock()
            .expect("catalogs lock")
            .retain(|(p, _), _| *p != id);
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

    /// Whether the model API key of provider `id` can be added by the egress proxy for a
    /// launch whose team secrets (and launch-only variables) are `secrets`: the
    /// brokering, or why the key stays inside the sandbox. Values are looked up as the
    /// CLI would see them: `secrets`, then the provider's `env`, then the server's
    /// environment for the variables it passes on.
    pub fn brokering(&self, id: &str, secrets: &SecretEnv) -> Result<Brokering, String> {
        let Some(src) = self.credentials.get(id) else {
            return Err(if id == "mock" {
                "the mock provider calls no model API".to_owned()
            } else {
                "an ACP agent of the settings talks to a model API agentry does not know".to_owned()
            });
        };
        let var = |name: &str| {
            secrets
                .get(name)
                .map(|v| v.expose().to_owned())
                .or_else(|| src.env.get(name).cloned())
                .or_else(|| {
                    src.pass_env
                        .iter()
                        .any(|p| p == name)
                        .then(|| std::env::var(name).ok())
                        .flatten()
                })
        };
        match src.credential {
            Credential::Inside(why) => Err(why.to_owned()),
            Credential::Brokerable(spec) => spec.resolve(id, var),
            Credential::Configured(decide) => decide(&BrokerInput {
                provider: id,
                args: &src.args,
                var: &var,
            }),
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<dyn Provider>> {
        self.providers.get(id).cloned()
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<dyn Provider>> {
        self.providers.values()
    }

    /// The models of provider `id` in `scope`, following the snapshot rule:
    /// - a cold scope is probed once (concurrent readers share that probe), and what it
    ///   answered — models or an error — stays until an explicit refresh: warm reads never
    ///   start a provider process;
    /// - a refresh of one workspace re-probes that workspace only;
    /// - a refresh of the global scope forgets every workspace scope of the provider (they
    ///   are probed again when next read) and re-probes the global one;
    /// - a failed refresh reports the failure and keeps the scope's last good catalog.
    ///
    /// `None` when no such provider exists. Errors are the probe's message.
    pub async fn models(
        &self,
        id: &str,
        scope: &CatalogScope,
        refresh: bool,
        probe: &Probe,
    ) -> Option<Result<Arc<Vec<ModelInfo>>, String>> {
        let provider = self.get(id)?;
        let key = (id.to_owned(), scope.clone());
        if refresh {
            let fresh = provider
                .models(probe)
                .await
                .map(Arc::new)
                .map_err(|e| e.to_string());
            let mut catalogs = self.catalogs.lock().expect("catalogs lock");
            if *scope == CatalogScope::Global {
                catalogs.retain(|(p, s), _| p != id || *s == CatalogScope::Global);
            }
            let keep_last_good = fresh.is_err()
                && catalogs
                    .get(&key)
                    .and_then(|slot| slot.get())
                    .is_some_and(Result::is_ok);
            if !keep_last_good {
                catalogs.insert(key, Arc::new(OnceCell::new_with(Some(fresh.clone()))));
            }
            return Some(fresh);
        }
        let slot = self
            .catalogs
            .lock()
            .expect("catalogs lock")
            .entry(key)
            .or_default()
            .clone();
        let answer = slot
            .get_or_init(|| async {
                provider
                    .models(probe)
                    .await
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .await;
        Some(answer.clone())
    }
}

/// One scope's catalog: empty while cold or being probed for the first time.
type Slot = Arc<OnceCell<Result<Arc<Vec<ModelInfo>>, String>>>;

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
        modes: modes_of(b.modes),
        default_mode: Some(b.default_mode.to_owned()),
        state_dir: None,
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

    /// Every provider the registry builds without settings is accepted as a settings
    /// table of its own (and every built-in CLI as a base to extend): the settings and the
    /// registry share one list.
    #[test]
    fn every_built_in_provider_is_accepted_as_a_settings_table() {
        for b in BuiltInCli::ALL {
            assert_eq!(builtin(b).id, b.id(), "the adapter of {b:?} has another id");
        }
        let registry = ProviderRegistry::from_settings(&BTreeMap::new()).expect("registry");
        let dir = tempfile::tempdir().unwrap();
        for id in ids(&registry) {
            let path = dir.path().join(format!("{id}.toml"));
            std::fs::write(&path, format!("[providers.{id}]\nenabled = true\n")).unwrap();
            let settings = crate::config::Settings::load_from(Some(&path), &[])
                .unwrap_or_else(|e| panic!("[providers.{id}] is refused: {e}"));
            assert_eq!(settings.providers[&id].enabled, Some(true));
            if id != "mock" {
                std::fs::write(
                    &path,
                    format!("[providers.second-{id}]\nextends = \"{id}\"\n"),
                )
                .unwrap();
                crate::config::Settings::load_from(Some(&path), &[])
                    .unwrap_or_else(|e| panic!("extends = \"{id}\" is refused: {e}"));
            }
        }
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
        Availability, EventSink, Launcher, ProcessLauncher, ProviderCapabilities, ProviderError,
        ProviderInfo, SessionSpec, Started,
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
            // A probe takes time: other readers get their turn meanwhile.
            tokio::task::yield_now().await;
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
            _launcher: Launcher,
            _events: EventSink,
        ) -> Started {
            Err(ProviderError::Unsupported("sessions"))
        }
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

    const GLOBAL: CatalogScope = CatalogScope::Global;

    fn probe() -> Probe {
        Probe {
            launcher: Arc::new(NoLaunch),
            cwd: std::env::temp_dir(),
        }
    }

    fn catalog(models: Vec<&'static str>) -> Arc<Catalog> {
        Arc::new(Catalog {
            source: Mutex::new(models),
            probes: AtomicUsize::new(0),
        })
    }

    async fn read(
        registry: &ProviderRegistry,
        scope: &CatalogScope,
        refresh: bool,
    ) -> Result<Vec<String>, String> {
        registry
            .models("cat", scope, refresh, &probe())
            .await
            .expect("the provider exists")
            .map(|m| m.iter().map(|m| m.id.clone()).collect())
    }

    #[tokio::test]
    async fn the_catalog_is_cached_and_a_refresh_replaces_it() {
        let provider = catalog(vec!["a"]);
        let mut registry = ProviderRegistry::new();
        registry.register(provider.clone());
        assert!(
            registry
                .models("nope", &GLOBAL, false, &probe())
                .await
                .is_none()
        );

        assert_eq!(read(&registry, &GLOBAL, false).await.unwrap(), ["a"]);
        *provider.source.lock().unwrap() = vec!["a", "b"];
        assert_eq!(
            read(&registry, &GLOBAL, false).await.unwrap(),
            ["a"],
            "served from the cache"
        );
        assert_eq!(provider.probes.load(Ordering::SeqCst), 1);

        assert_eq!(
            read(&registry, &GLOBAL, true).await.unwrap(),
            ["a", "b"],
            "a refresh probes again"
        );
        assert_eq!(
            read(&registry, &GLOBAL, false).await.unwrap(),
            ["a", "b"],
            "and replaces the cache"
        );

        // A failed refresh reports the failure and keeps the last good catalog.
        provider.source.lock().unwrap().clear();
        assert!(read(&registry, &GLOBAL, true).await.is_err());
        assert_eq!(read(&registry, &GLOBAL, false).await.unwrap(), ["a", "b"]);
        assert_eq!(provider.probes.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn each_workspace_has_its_own_catalog_and_a_global_refresh_forgets_them() {
        let provider = catalog(vec!["a"]);
        let mut registry = ProviderRegistry::new();
        registry.register(provider.clone());
        let one = CatalogScope::Workspace("/w/one".into());
        let two = CatalogScope::Workspace("/w/two".into());
        let probes = || provider.probes.load(Ordering::SeqCst);

        assert_eq!(read(&registry, &GLOBAL, false).await.unwrap(), ["a"]);
        assert_eq!(read(&registry, &one, false).await.unwrap(), ["a"]);
        assert_eq!(probes(), 2, "a cold scope is probed");
        *provider.source.lock().unwrap() = vec!["b"];
        assert_eq!(read(&registry, &two, false).await.unwrap(), ["b"]);
        assert_eq!(
            read(&registry, &one, false).await.unwrap(),
            ["a"],
            "warm: no probe"
        );
        assert_eq!(probes(), 3);

        // A workspace refresh touches that workspace only.
        assert_eq!(read(&registry, &one, true).await.unwrap(), ["b"]);
        assert_eq!(read(&registry, &GLOBAL, false).await.unwrap(), ["a"]);
        assert_eq!(probes(), 4);

        // A global refresh probes the global scope at once and the workspaces lazily.
        *provider.source.lock().unwrap() = vec!["c"];
        assert_eq!(read(&registry, &GLOBAL, true).await.unwrap(), ["c"]);
        assert_eq!(probes(), 5, "only the global scope was probed");
        assert_eq!(read(&registry, &two, false).await.unwrap(), ["c"]);
        assert_eq!(probes(), 6, "a forgotten workspace is probed when read");
    }

    #[tokio::test]
    async fn a_failed_first_probe_stays_until_a_refresh() {
        let provider = catalog(vec![]);
        let mut registry = ProviderRegistry::new();
        registry.register(provider.clone());
        assert!(read(&registry, &GLOBAL, false).await.is_err());
        *provider.source.lock().unwrap() = vec!["a"];
        assert!(
            read(&registry, &GLOBAL, false).await.is_err(),
            "warm error: no probe"
        );
        assert_eq!(provider.probes.load(Ordering::SeqCst), 1);
        assert_eq!(read(&registry, &GLOBAL, true).await.unwrap(), ["a"]);
    }

    #[tokio::test]
    async fn concurrent_cold_reads_share_one_probe() {
        let provider = catalog(vec!["a"]);
        let mut registry = ProviderRegistry::new();
        registry.register(provider.clone());
        let reads: Vec<_> = (0..8).map(|_| read(&registry, &GLOBAL, false)).collect();
        for r in futures::future::join_all(reads).await {
            assert_eq!(r.unwrap(), ["a"]);
        }
        assert_eq!(provider.probes.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn building_the_registry_probes_nothing() {
        let provider = catalog(vec!["a"]);
        let mut registry = ProviderRegistry::new();
        registry.register(provider.clone());
        assert_eq!(read(&registry, &GLOBAL, false).await.unwrap(), ["a"]);
        // Registering the provider again (a new configuration) forgets its catalogs
        // without probing; the next read does.
        registry.register(provider.clone());
        assert_eq!(provider.probes.load(Ordering::SeqCst), 1);
        assert_eq!(read(&registry, &GLOBAL, false).await.unwrap(), ["a"]);
        assert_eq!(provider.probes.load(Ordering::SeqCst), 2);
    }
}
