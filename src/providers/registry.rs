//! The providers a server offers, by id: the built-in `mock` and one ACP provider per
//! `[providers.<id>]` table with `extends = "acp"`, built from the settings at start.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::config::ProviderSettings;

use super::acp::{AcpProvider, AcpProviderConfig};
use super::mock::mock_provider;
use super::{ModeInfo, Provider};

/// Why the registry could not be built from the settings.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("cannot find the agentry executable for the mock provider: {0}")]
    MockExecutable(#[source] std::io::Error),
}

/// The providers this server knows, by id.
#[derive(Clone, Default)]
pub struct ProviderRegistry {
    providers: BTreeMap<String, Arc<dyn Provider>>,
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
        for (id, p) in providers {
            if p.extends.as_deref() != Some("acp") || p.enabled == Some(false) {
                continue;
            }
            registry.register(Arc::new(AcpProvider::new(acp_config(id, p))));
        }
        Ok(registry)
    }

    pub fn register(&mut self, provider: Arc<dyn Provider>) {
        self.providers.insert(provider.info().id, provider);
    }

    pub fn get(&self, id: &str) -> Option<Arc<dyn Provider>> {
        self.providers.get(id).cloned()
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<dyn Provider>> {
        self.providers.values()
    }
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
        modes: p
            .modes
            .iter()
            .map(|m| ModeInfo {
                id: m.id.clone(),
                label: m.label.clone().unwrap_or_else(|| m.id.clone()),
                description: m.description.clone(),
                unattended: m.unattended,
            })
            .collect(),
        default_mode: p.default_mode.clone(),
        models: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(registry: &ProviderRegistry) -> Vec<String> {
        registry.all().map(|p| p.info().id).collect()
    }

    #[test]
    fn mock_is_offered_by_default() {
        let registry = ProviderRegistry::from_settings(&BTreeMap::new()).expect("registry");
        assert_eq!(ids(&registry), ["mock"]);
    }

    #[test]
    fn acp_tables_become_providers() {
        let toml = r#"
            [mock]
            enabled = false
            [gemini]
            extends = "acp"
            command = ["gemini", "--experimental-acp"]
            args = ["--yolo"]
            label = "Gemini CLI"
            default_mode = "default"
            modes = [{ id = "default" }]
            [off]
            extends = "acp"
            enabled = false
        "#;
        let providers: BTreeMap<String, ProviderSettings> = toml::from_str(toml).expect("toml");
        let registry = ProviderRegistry::from_settings(&providers).expect("registry");
        assert_eq!(ids(&registry), ["gemini"]);

        let config = acp_config("gemini", &providers["gemini"]);
        assert_eq!(config.command, ["gemini", "--experimental-acp", "--yolo"]);
        assert_eq!(config.label, "Gemini CLI");
        assert_eq!(config.modes.len(), 1);
        assert_eq!(config.modes[0].label, "default");
        assert_eq!(config.default_mode.as_deref(), Some("default"));

        let bare = acp_config("opencode", &ProviderSettings::default());
        assert_eq!(bare.command, ["opencode"]);
        assert_eq!(bare.label, "opencode");
    }
}
