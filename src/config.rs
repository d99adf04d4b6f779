//! Settings: built-in defaults, overlaid by an optional TOML file (`--config` /
//! `AGENTRY_CONFIG`), overlaid by `AGENTRY_*` environment variables (`__` separates
//! nested keys: `AGENTRY_DATABASE__URL`) and `DATABASE_URL`. Validated once at start;
//! errors name the setting. Secrets are wrapped so `Debug` never shows them.

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
    /// Identifies this server process among replicas (defaults to the host name).
    pub replica_id: Option<String>,
    pub database: DatabaseSettings,
    pub auth: AuthSettings,
    pub log: LogSettings,
    pub limits: Limits,
    pub events: EventSettings,
    /// One table per provider id.
    pub providers: BTreeMap<String, ProviderSettings>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseSettings {
    /// `postgres://…`; absent → the embedded PostgreSQL.
    pub url: Option<Secret>,
    pub max_connections: u32,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSettings {
    /// OIDC settings; accepted and kept for the SSO capability.
    pub oidc: Option<toml::Table>,
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
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventSettings {
    /// Flush a batch at this many events…
    pub batch_max_events: usize,
    /// …or after this many milliseconds, whichever comes first.
    pub batch_linger_ms: u64,
    /// Events buffered per SSE connection before it resyncs from the database.
    pub subscriber_buffer: usize,
    /// Seconds between SSE keep-alive comments.
    pub ping_interval_s: u64,
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
            providers: BTreeMap::new(),
        }
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
        }
    }
}

impl Default for EventSettings {
    fn default() -> Self {
        Self {
            batch_max_events: 4096,
            batch_linger_ms: 0,
            subscriber_buffer: 1024,
            ping_interval_s: 15,
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
        for (name, raw) in env {
            let path: Vec<String> = if name == "DATABASE_URL" {
                vec!["database".into(), "url".into()]
            } else if let Some(rest) = name.strip_prefix("AGENTRY_") {
                if rest == "CONFIG" || rest.is_empty() {
                    continue;
                }
                rest.split("__").map(|s| s.to_ascii_lowercase()).collect()
            } else {
                continue;
            };
            if name == "DATABASE_URL" && env.iter().any(|(n, _)| n == "AGENTRY_DATABASE__URL") {
                continue;
            }
            set_path(&mut table, &path, env_value(raw));
        }
        let settings: Settings = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| invalid(&setting_name_of(&e), e.message().to_string()))?;
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
        if self.database.max_connections == 0 {
            self.database.max_connections = 32;
        }
        if !matches!(self.log.format.as_str(), "text" | "json") {
            return Err(invalid("log.format", "must be `text` or `json`"));
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
        if self.events.batch_max_events == 0 {
            return Err(invalid("events.batch_max_events", "must be at least 1"));
        }
        if self.events.subscriber_buffer < 16 {
            return Err(invalid("events.subscriber_buffer", "must be at least 16"));
        }
        if self.events.ping_interval_s == 0 {
            return Err(invalid("events.ping_interval_s", "must be at least 1"));
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
            if let Some(ext) = &p.extends
                && ext != "acp"
            {
                return Err(invalid(
                    &format!("providers.{id}.extends"),
                    "only `acp` can be extended",
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

    pub fn replica(&self) -> String {
        self.replica_id.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "local".into())
        })
    }
}

fn valid_provider_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 40
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// An environment value: a TOML scalar when it parses as one (`8080`, `true`), else text.
fn env_value(raw: &str) -> toml::Value {
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
    // Strings stay strings for keys that are strings by nature.
    let value = match (last.as_str(), value) {
        (
            "url" | "listen" | "data_dir" | "format" | "filter" | "otlp_endpoint" | "replica_id",
            v,
        ) if !v.is_str() => toml::Value::String(v.to_string()),
        (_, v) => v,
    };
    cur.insert(last.clone(), value);
}

fn setting_name_of(e: &toml::de::Error) -> String {
    // toml's messages name the unknown or mistyped key; keep the whole message in `message`.
    let msg = e.message();
    if let Some(start) = msg.find('`')
        && let Some(len) = msg[start + 1..].find('`')
    {
        return msg[start + 1..start + 1 + len].to_owned();
    }
    "config".into()
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
