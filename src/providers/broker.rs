//! Credential brokering as a provider describes it: the variable its CLI reads the model
//! API's base URL from, the variables that carry its key and the header each key travels
//! upstream in. When an agent runs behind the egress proxy, its CLI is given the agent's
//! brokered base URL and a placeholder key; the proxy adds the real key on the way out,
//! so the key is in no variable and no file inside the sandbox.

use std::collections::BTreeMap;

use serde_json::Value;
use url::Url;

use crate::domain::SecretValue;
use crate::egress::{Brokered, brokered_base_url};

/// The key a CLI is given in place of the real one (CLIs refuse to start without one).
pub const PLACEHOLDER_KEY: &str = "agentry-brokered-key";

/// How a key is sent upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyHeader {
    /// `<name>: <key>`.
    Named(&'static str),
    /// `Authorization: Bearer <key>`.
    Bearer,
}

/// A variable a CLI takes its model API key from.
#[derive(Debug, Clone, Copy)]
pub struct KeyVar {
    pub var: &'static str,
    pub header: KeyHeader,
}

/// How a provider's credential can be kept outside the sandbox.
#[derive(Debug, Clone, Copy)]
pub enum Credential {
    /// The CLI takes its base URL from `base_url_var`: it can be brokered.
    Brokerable(BrokerSpec),
    /// The CLI takes its base URL from its own configuration (arguments, a JSON
    /// variable): the adapter reads that configuration and says how to rewrite it.
    Configured(fn(&BrokerInput<'_>) -> Result<Brokering, String>),
    /// It cannot: why.
    Inside(&'static str),
}

/// What a `Credential::Configured` adapter decides from: the CLI's configured arguments
/// and each variable's value as the CLI would see it.
pub struct BrokerInput<'a> {
    pub provider: &'a str,
    /// The provider's `args` setting.
    pub args: &'a [String],
    pub var: &'a dyn Fn(&str) -> Option<String>,
}

impl BrokerInput<'_> {
    /// A variable's value, when it is set and not empty.
    pub fn set(&self, name: &str) -> Option<String> {
        (self.var)(name).filter(|v| !v.is_empty())
    }

    /// What the CLI sends under `…/<prefix>` goes on to `upstream_base`, with `key` in
    /// `header`.
    pub fn brokered(
        &self,
        prefix: String,
        upstream_base: Url,
        header: KeyHeader,
        key: String,
    ) -> Brokered {
        Brokered {
            provider: self.provider.to_owned(),
            path_prefix: prefix,
            upstream_base,
            headers: vec![key_header(header, key)],
        }
    }
}

/// A value set inside the JSON object a variable of the CLI holds (OpenCode's
/// configuration): `path` names nested object keys, made when missing.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonSet {
    pub var: String,
    pub path: Vec<String>,
    pub value: Value,
}

/// The header that carries `key` upstream.
pub fn key_header(header: KeyHeader, key: String) -> (String, SecretValue) {
    match header {
        KeyHeader::Named(name) => (name.to_owned(), SecretValue::new(key)),
        KeyHeader::Bearer => (
            "Authorization".to_owned(),
            SecretValue::new(format!("Bearer {key}")),
        ),
    }
}

/// `text` as an http(s) URL with a host, the upstream of a brokered provider.
pub fn upstream_url(text: &str) -> Option<Url> {
    Url::parse(text)
        .ok()
        .filter(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some())
}

/// A CLI whose model API base URL is a variable.
#[derive(Debug, Clone, Copy)]
pub struct BrokerSpec {
    /// The path of the provider under an agent's endpoint (`/anthropic/…`).
    pub prefix: &'static str,
    /// The variable the CLI reads its base URL from.
    pub base_url_var: &'static str,
    /// The upstream when the configuration names none (`None`: one must be configured).
    pub default_upstream: Option<&'static str>,
    /// The key variables, in the order the CLI prefers them. Every one is withheld from
    /// the CLI; the first that is set is the one brokered.
    pub keys: &'static [KeyVar],
    /// Variables that, when set, make the CLI use a credential that is not a key in a
    /// header (a cloud account, a login): (variable, why it stays inside).
    pub not_with: &'static [(&'static str, &'static str)],
    /// A variable that must be unset or hold one of these values (the kind of API a
    /// configurable CLI talks to, which decides the key's header).
    pub only_when: Option<(&'static str, &'static [&'static str])>,
}

/// One launch's brokering: what the proxy adds and what the CLI is given instead.
#[derive(Debug, Clone, Default)]
pub struct Brokering {
    /// One per upstream the CLI's configuration names (each under its own path).
    pub brokered: Vec<Brokered>,
    /// Variables the CLI must not get from anywhere (every key variable).
    pub withhold: Vec<String>,
    /// Variables set for the CLI: the brokered base URL and the placeholder key.
    pub env: BTreeMap<String, String>,
    /// Arguments appended to the CLI's own (configuration overrides).
    pub args: Vec<String>,
    /// Values set in the JSON configuration a variable of the CLI holds.
    pub json_env: Vec<JsonSet>,
    /// Files shown read-only inside the sandbox at these paths in place of what is there:
    /// (path, contents). A configuration file rewritten with the brokered URL.
    pub files: Vec<(std::path::PathBuf, String)>,
}

impl BrokerSpec {
    /// The brokering of a launch where `var` gives each variable's value as the CLI
    /// would see it; `Err`: why the credential stays inside.
    pub fn resolve(
        &self,
        provider: &str,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Brokering, String> {
        let set = |name: &str| var(name).filter(|v| !v.is_empty());
        for (name, why) in self.not_with {
            if set(name).is_some() {
                return Err(format!("{name} is set: {why}"));
            }
        }
        if let Some((name, values)) = self.only_when
            && let Some(v) = set(name)
            && !values.contains(&v.as_str())
        {
            return Err(format!(
                "{name} is `{v}`: only {} is brokered",
                values.join(", ")
            ));
        }
        let Some((key_var, key)) = self.keys.iter().find_map(|k| set(k.var).map(|v| (k, v))) else {
            let names: Vec<&str> = self.keys.iter().map(|k| k.var).collect();
            return Err(format!(
                "none of {} is set: the CLI uses its own login, kept in its home",
                names.join(", ")
            ));
        };
        let upstream = match set(self.base_url_var) {
            Some(u) => u,
            None => match self.default_upstream {
                Some(u) => u.to_owned(),
                None => return Err(format!("{} is not set", self.base_url_var)),
            },
        };
        let upstream_base = upstream_url(&upstream)
            .ok_or_else(|| format!("{} is not an http(s) URL", self.base_url_var))?;
        let header = key_header(key_var.header, key);
        let env = BTreeMap::from([
            (self.base_url_var.to_owned(), brokered_base_url(self.prefix)),
            (key_var.var.to_owned(), PLACEHOLDER_KEY.to_owned()),
        ]);
        Ok(Brokering {
            brokered: vec![Brokered {
                provider: provider.to_owned(),
                path_prefix: self.prefix.to_owned(),
                upstream_base,
                headers: vec![header],
            }],
            withhold: self.keys.iter().map(|k| k.var.to_owned()).collect(),
            env,
            ..Brokering::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: BrokerSpec = BrokerSpec {
        prefix: "anthropic",
        base_url_var: "BASE",
        default_upstream: Some("https://api.example.com"),
        keys: &[
            KeyVar {
                var: "API_KEY",
                header: KeyHeader::Named("x-api-key"),
            },
            KeyVar {
                var: "TOKEN",
                header: KeyHeader::Bearer,
            },
        ],
        not_with: &[("USE_CLOUD", "the cloud's own credentials are used")],
        only_when: Some(("KIND", &["openai"])),
    };

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn the_first_key_set_is_brokered_to_the_configured_upstream() {
        let b = SPEC
            .resolve(
                "claude",
                vars(&[("TOKEN", "tok"), ("BASE", "http://127.0.0.1:9/v1")]),
            )
            .unwrap();
        assert_eq!(
            b.brokered[0].upstream_base.as_str(),
            "http://127.0.0.1:9/v1"
        );
        assert_eq!(b.brokered[0].headers[0].0, "Authorization");
        assert_eq!(b.brokered[0].headers[0].1.expose(), "Bearer tok");
        assert_eq!(b.withhold, ["API_KEY", "TOKEN"]);
        assert_eq!(b.env["BASE"], "http://127.0.0.1:3128/anthropic");
        assert_eq!(b.env["TOKEN"], PLACEHOLDER_KEY);
        assert!(!b.env.contains_key("API_KEY"));

        let b = SPEC
            .resolve("claude", vars(&[("API_KEY", "k"), ("TOKEN", "t")]))
            .unwrap();
        assert_eq!(
            b.brokered[0].upstream_base.as_str(),
            "https://api.example.com/"
        );
        assert_eq!(b.brokered[0].headers[0].0, "x-api-key");
        assert_eq!(b.brokered[0].headers[0].1.expose(), "k");
    }

    #[test]
    fn other_credentials_stay_inside_with_the_reason() {
        let why = SPEC.resolve("c", vars(&[])).unwrap_err();
        assert!(why.contains("API_KEY, TOKEN"), "{why}");
        let why = SPEC
            .resolve("c", vars(&[("API_KEY", "k"), ("USE_CLOUD", "1")]))
            .unwrap_err();
        assert!(why.starts_with("USE_CLOUD is set"), "{why}");
        let why = SPEC
            .resolve("c", vars(&[("API_KEY", "k"), ("KIND", "azure")]))
            .unwrap_err();
        assert!(why.contains("`azure`"), "{why}");
        assert!(
            SPEC.resolve("c", vars(&[("API_KEY", "k"), ("KIND", "openai")]))
                .is_ok()
        );
        let why = SPEC
            .resolve("c", vars(&[("API_KEY", "k"), ("BASE", "file:///x")]))
            .unwrap_err();
        assert!(why.contains("BASE"), "{why}");
    }
}
