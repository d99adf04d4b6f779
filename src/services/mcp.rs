//! The MCP servers of an agent. A stdio server is one of the server's own commands:
//! defined in the settings (`[mcp.servers.<name>]`, with the teams that may use it) and
//! named by agents as `{"server": "<settings name>"}`; no request ever names a command.
//! A remote server is given by URL (`{"type": "http" | "sse", "url", "headers"?}`), under
//! the same address rule as team hooks unless `mcp.allow_private_networks`.
//!
//! Remote `headers` values are credentials: sealed with the team's keyring before they are
//! stored, masked wherever the configuration is shown (hook payloads), and opened only to
//! hand the resolved definitions to a provider at launch.

use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::secrets::{Keyring, Sealed};
use super::{Access, Data, ServiceError, ServiceResult};
use crate::config::{HookSettings, McpSettings};
use crate::domain::SecretValue;

/// What a masked credential reads as in a hook payload; a hook that returns it unchanged
/// keeps the stored value.
pub const MASK: &str = "[masked]";

fn invalid(name: &str, key: &str, message: impl Into<String>) -> ServiceError {
    let field = if key.is_empty() {
        format!("mcp_servers.{name}")
    } else {
        format!("mcp_servers.{name}.{key}")
    };
    ServiceError::InvalidAt {
        field,
        message: message.into(),
    }
}

/// The shape of `mcp_servers` and the rules that need no team: a `command` (or `args`,
/// `env`) is refused by name, a named server must exist in the settings, a remote one
/// needs an allowed http(s) URL and string headers.
pub fn check(settings: &McpSettings, servers: &Value) -> ServiceResult<()> {
    let Some(servers) = servers.as_object() else {
        return Err(ServiceError::invalid(
            "mcp_servers",
            "must be an object keyed by server name",
        ));
    };
    if servers.len() > 50 {
        return Err(ServiceError::invalid(
            "mcp_servers",
            "at most 50 MCP servers",
        ));
    }
    for (name, server) in servers {
        if name.is_empty() || name.len() > 100 {
            return Err(ServiceError::invalid(
                "mcp_servers",
                "server names are 1 to 100 characters",
            ));
        }
        let Some(server) = server.as_object() else {
            return Err(invalid(name, "", "must be an object"));
        };
        for key in ["command", "args", "env"] {
            if server.contains_key(key) {
                return Err(invalid(
                    name,
                    key,
                    "stdio MCP servers are defined in the server's settings \
                     (`[mcp.servers.<name>]`); name one with `server`",
                ));
            }
        }
        match server.get("type").map(|t| t.as_str()) {
            None | Some(Some("stdio" | "local")) => {
                let Some(named) = server.get("server") else {
                    return Err(invalid(
                        name,
                        "server",
                        "required: the name of an MCP server of the settings",
                    ));
                };
                if let Some(extra) = server
                    .keys()
                    .find(|k| !matches!(k.as_str(), "server" | "type"))
                {
                    return Err(invalid(name, extra, "not a field of a named MCP server"));
                }
                if !named
                    .as_str()
                    .is_some_and(|n| settings.servers.contains_key(n))
                {
                    return Err(not_usable(name));
                }
            }
            Some(Some("http" | "sse")) => {
                if let Some(extra) = server
                    .keys()
                    .find(|k| !matches!(k.as_str(), "type" | "url" | "headers"))
                {
                    return Err(invalid(name, extra, "not a field of a remote MCP server"));
                }
                let Some(url) = server.get("url").and_then(Value::as_str) else {
                    return Err(invalid(
                        name,
                        "url",
                        "a remote MCP server needs an http:// or https:// `url`",
                    ));
                };
                let rule = HookSettings {
                    allow_private_networks: settings.allow_private_networks,
                    ..HookSettings::default()
                };
                super::hooks::check_url(url, true, &rule)
                    .map_err(|e| invalid(name, "url", e.replace("hook", "MCP server")))?;
                let headers_ok = server.get("headers").is_none_or(|h| {
                    h.as_object()
                        .is_some_and(|m| m.len() <= 50 && m.values().all(Value::is_string))
                });
                if !headers_ok {
                    return Err(invalid(name, "headers", "must be an object of strings"));
                }
            }
            _ => {
                return Err(invalid(
                    name,
                    "type",
                    "must be `stdio` (a server of the settings), `http` or `sse`",
                ));
            }
        }
    }
    Ok(())
}

/// Remote servers' hosts, resolved now, reach no internal address (unless
/// `mcp.allow_private_networks`): the provider CLI resolves the name itself, so a name
/// that points inside (`/etc/hosts`, a DNS record) is refused like a literal address.
/// A name that does not resolve is left to the CLI, which cannot reach it either.
#[tracing::instrument(name = "services::mcp::check_addresses", skip_all)]
pub async fn check_addresses(settings: &McpSettings, servers: &Value) -> ServiceResult<()> {
    if settings.allow_private_networks {
        return Ok(());
    }
    for (name, server) in servers.as_object().into_iter().flatten() {
        let Some(url) = server
            .get("url")
            .and_then(Value::as_str)
            .and_then(|u| url::Url::parse(u).ok())
        else {
            continue;
        };
        let Some(url::Host::Domain(host)) = url.host() else {
            continue;
        };
        let port = url.port_or_known_default().unwrap_or(443);
        let lookup = tokio::net::lookup_host((host, port));
        let Ok(Ok(addrs)) = tokio::time::timeout(std::time::Duration::from_secs(5), lookup).await
        else {
            continue;
        };
        if let Some(bad) = addrs
            .map(|a| a.ip())
            .find(|ip| super::hooks::is_internal(*ip))
        {
            return Err(invalid(
                name,
                "url",
                format!("`{host}` resolves to {bad}, a loopback, private or link-local address"),
            ));
        }
    }
    Ok(())
}

/// The same refusal for a server the settings do not define and one the team may not
/// use, so a member learns nothing about other teams' servers.
fn not_usable(name: &str) -> ServiceError {
    invalid(
        name,
        "server",
        "not an MCP server of the settings that this team may use",
    )
}

/// Every server named from the settings is one `team_name` may use.
pub fn check_team(settings: &McpSettings, team_name: &str, servers: &Value) -> ServiceResult<()> {
    for (name, server) in servers.as_object().into_iter().flatten() {
        if let Some(named) = server.get("server") {
            let allowed = named
                .as_str()
                .and_then(|n| settings.servers.get(n))
                .is_some_and(|s| s.allows(team_name));
            if !allowed {
                return Err(not_usable(name));
            }
        }
    }
    Ok(())
}

/// The definitions a provider is handed: named servers become their settings' `command`,
/// `args` and `env`; remote ones pass as they are (opened). A server the team may no
/// longer use (the settings changed) is refused.
pub fn resolve(settings: &McpSettings, team_name: &str, servers: &Value) -> ServiceResult<Value> {
    check_team(settings, team_name, servers)?;
    let mut out = Map::new();
    for (name, server) in servers.as_object().into_iter().flatten() {
        let resolved = match server.get("server").and_then(Value::as_str) {
            Some(named) => {
                let Some(def) = settings.servers.get(named) else {
                    return Err(not_usable(name));
                };
                let env: Map<String, Value> = def
                    .env
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::from(v.expose())))
                    .collect();
                json!({"type": "stdio", "command": def.command, "args": def.args, "env": env})
            }
            // A remote server; anything else (a command stored before commands were
            // refused) is never handed on.
            None if matches!(
                server.get("type").and_then(Value::as_str),
                Some("http" | "sse")
            ) =>
            {
                server.clone()
            }
            None => {
                return Err(invalid(
                    name,
                    "command",
                    "stdio MCP servers are defined in the server's settings \
                     (`[mcp.servers.<name>]`); name one with `server`",
                ));
            }
        };
        out.insert(name.clone(), resolved);
    }
    Ok(Value::Object(out))
}

/// The name a header value is sealed under (bound into the ciphertext).
fn sealed_name(server: &str, header: &str) -> String {
    format!("mcp_servers.{server}.headers.{header}")
}

/// Remote servers' header values replaced by their sealed form, for storage.
pub fn seal(keyring: &Keyring, team: Uuid, servers: &Value) -> Value {
    map_headers(servers, |server, header, value| {
        let Some(plain) = value.as_str() else {
            return value.clone();
        };
        let sealed = keyring.seal(team, &sealed_name(server, header), &SecretValue::new(plain));
        json!({"sealed": {
            "key_id": sealed.key_id,
            "nonce": hex::encode(&sealed.nonce),
            "ciphertext": hex::encode(&sealed.ciphertext),
        }})
    })
}

/// Seal the header values agents stored in the clear before they were sealed on write
/// (run once at start; values already sealed are left as they are). Returns how many
/// agents changed.
#[tracing::instrument(name = "services::mcp::seal_stored", skip_all)]
pub async fn seal_stored(data: &Data, access: &Access) -> ServiceResult<usize> {
    let rows = crate::store::bounds::agents_with_mcp_headers(&data.pool).await?;
    let mut changed = 0;
    for (id, team, servers) in rows {
        let sealed = seal(&access.secrets, team, &servers);
        if sealed != servers {
            crate::store::bounds::set_mcp_servers(&data.pool, id, &sealed).await?;
            changed += 1;
        }
    }
    Ok(changed)
}

/// Stored servers with their header values opened; a value that cannot be opened (its
/// key is gone) makes the launch fail with the reason.
pub fn open(keyring: &Keyring, team: Uuid, servers: &Value) -> ServiceResult<Value> {
    let mut failure = None;
    let opened = map_headers(servers, |server, header, value| {
        let Some(sealed) = value.get("sealed") else {
            return value.clone();
        };
        let field = |k: &str| sealed.get(k).and_then(Value::as_str).unwrap_or_default();
        let parsed = Sealed {
            key_id: field("key_id").to_owned(),
            nonce: hex::decode(field("nonce")).unwrap_or_default(),
            ciphertext: hex::decode(field("ciphertext")).unwrap_or_default(),
        };
        match keyring.open(team, &sealed_name(server, header), &parsed) {
            Ok(v) => Value::from(v.expose()),
            Err(e) => {
                failure = Some(invalid(
                    server,
                    "headers",
                    format!("the stored value of `{header}` cannot be opened: {e}"),
                ));
                Value::Null
            }
        }
    });
    match failure {
        Some(e) => Err(e),
        None => Ok(opened),
    }
}

/// Remote servers' header values replaced by `MASK`, for hook payloads.
pub fn mask(servers: &Value) -> Value {
    map_headers(servers, |_, _, _| Value::from(MASK))
}

/// `returned` (from a hook that saw `mask(original)`) with each masked header value that
/// is still `MASK` put back from `original`.
pub fn unmask(returned: &Value, original: &Value) -> Value {
    map_headers(returned, |server, header, value| {
        if value.as_str() == Some(MASK) {
            original[server]["headers"][header].clone()
        } else {
            value.clone()
        }
    })
}

fn map_headers(servers: &Value, mut f: impl FnMut(&str, &str, &Value) -> Value) -> Value {
    let Some(map) = servers.as_object() else {
        return servers.clone();
    };
    let mut out = map.clone();
    for (name, server) in out.iter_mut() {
        if let Some(headers) = server.get_mut("headers").and_then(Value::as_object_mut) {
            for (h, v) in headers.iter_mut() {
                *v = f(name, h, v);
            }
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::config::{McpServerSetting, Secret};

    fn settings() -> McpSettings {
        McpSettings {
            allow_private_networks: false,
            servers: BTreeMap::from([
                (
                    "files".to_owned(),
                    McpServerSetting {
                        command: "mcp-files".into(),
                        args: vec!["--root".into(), ".".into()],
                        env: BTreeMap::from([("TOKEN".to_owned(), Secret::new("t0k"))]),
                        teams: Some(vec!["web".into()]),
                    },
                ),
                (
                    "open".to_owned(),
                    McpServerSetting {
                        command: "mcp-open".into(),
                        args: vec![],
                        env: BTreeMap::new(),
                        teams: None,
                    },
                ),
            ]),
        }
    }

    fn field_of(e: ServiceError) -> String {
        match e {
            ServiceError::InvalidAt { field, .. } => field,
            ServiceError::Invalid { field, .. } => field.to_owned(),
            other => panic!("not a validation error: {other}"),
        }
    }

    #[test]
    fn a_command_is_refused_by_its_field() {
        let s = settings();
        for (servers, field) in [
            (
                json!({"x": {"command": "touch /tmp/m"}}),
                "mcp_servers.x.command",
            ),
            (
                json!({"x": {"type": "stdio", "command": ["sh"]}}),
                "mcp_servers.x.command",
            ),
            (
                json!({"x": {"server": "files", "args": ["-e"]}}),
                "mcp_servers.x.args",
            ),
            (
                json!({"x": {"server": "files", "env": {"A": "1"}}}),
                "mcp_servers.x.env",
            ),
            (json!({"x": {}}), "mcp_servers.x.server"),
            (json!({"x": {"server": "nope"}}), "mcp_servers.x.server"),
            (json!({"x": {"type": "ftp"}}), "mcp_servers.x.type"),
            (
                json!({"x": {"type": "http", "url": "http://127.0.0.1/mcp"}}),
                "mcp_servers.x.url",
            ),
            (
                json!({"x": {"type": "http", "url": "http://[64:ff9b::a00:1]/"}}),
                "mcp_servers.x.url",
            ),
            (
                json!({"x": {"type": "http", "url": "file:///etc"}}),
                "mcp_servers.x.url",
            ),
            (
                json!({"x": {"type": "http", "url": "https://a.example/", "headers": {"k": 1}}}),
                "mcp_servers.x.headers",
            ),
        ] {
            let e = check(&s, &servers).expect_err(&servers.to_string());
            assert_eq!(field_of(e), field, "{servers}");
        }
        assert!(check(&s, &json!({"f": {"server": "files"}, "r": {"type": "sse", "url": "https://mcp.example.com/sse", "headers": {"Authorization": "Bearer x"}}})).is_ok());
        let open = McpSettings {
            allow_private_networks: true,
            ..settings()
        };
        assert!(
            check(
                &open,
                &json!({"x": {"type": "http", "url": "http://127.0.0.1/mcp"}})
            )
            .is_ok()
        );
    }

    #[test]
    fn named_servers_follow_their_teams_and_resolve_to_the_settings() {
        let s = settings();
        let servers = json!({"f": {"server": "files"}, "o": {"server": "open"}});
        assert!(check_team(&s, "web", &servers).is_ok());
        let e = check_team(&s, "ops", &servers).unwrap_err();
        assert_eq!(field_of(e), "mcp_servers.f.server");
        assert!(check_team(&s, "ops", &json!({"o": {"server": "open"}})).is_ok());
        let r = resolve(&s, "web", &servers).unwrap();
        assert_eq!(
            r["f"],
            json!({"type": "stdio", "command": "mcp-files", "args": ["--root", "."], "env": {"TOKEN": "t0k"}})
        );
        assert!(resolve(&s, "ops", &servers).is_err());
        let stored_command = json!({"x": {"command": "touch", "args": ["/tmp/m"]}});
        let e = resolve(&s, "web", &stored_command).unwrap_err();
        assert_eq!(field_of(e), "mcp_servers.x.command", "never handed on");
    }

    #[test]
    fn header_values_are_sealed_masked_and_opened() {
        let keyring = Keyring::new(&[7u8; 32], &[]);
        let team = Uuid::now_v7();
        let servers = json!({"r": {"type": "http", "url": "https://m.example/", "headers": {"Authorization": "Bearer s3cr3t-value"}}, "f": {"server": "files"}});
        let sealed = seal(&keyring, team, &servers);
        assert!(!sealed.to_string().contains("s3cr3t-value"), "{sealed}");
        assert_eq!(sealed["f"], servers["f"]);
        assert_eq!(open(&keyring, team, &sealed).unwrap(), servers);
        assert!(
            open(&keyring, Uuid::now_v7(), &sealed).is_err(),
            "bound to the team"
        );
        let masked = mask(&servers);
        assert_eq!(masked["r"]["headers"]["Authorization"], MASK);
        assert_eq!(unmask(&masked, &servers), servers);
        let mut changed = masked.clone();
        changed["r"]["headers"]["Authorization"] = json!("Bearer other");
        assert_eq!(
            unmask(&changed, &servers)["r"]["headers"]["Authorization"],
            "Bearer other"
        );
    }
}
