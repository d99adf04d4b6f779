//! Network policy of agents: the allow list the egress proxy checks an agent's
//! connections against. An agent's list is its provider's (built in, or replaced by
//! `[egress.providers.<id>]`), plus the server's (`egress.allow`), plus its team's —
//! which the team's owners set through the API (every member of the team reads it). A
//! workspace's setup and teardown commands get the server's and the team's entries only:
//! no provider runs them.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;
use uuid::Uuid;

use super::audit::{self, Action, Entry};
use super::{Data, ServiceError, ServiceResult, within_deadline};
use crate::auth::{Operation, Principal};
use crate::config::EgressSettings;
use crate::domain::{TeamId, UserId};
use crate::egress::{AllowEntry, AllowList};
use crate::store;

/// Most entries a team may add.
pub const MAX_TEAM_ENTRIES: usize = 100;

/// The hosts each built-in provider's CLI needs: its model APIs and the sign-in and
/// token endpoints of its own login. A provider not listed (the mock, an ACP agent of the
/// settings) reaches nothing unless the settings or its team allow it.
pub const PROVIDER_DEFAULTS: &[(&str, &[&str])] = &[
    ("claude", &["api.anthropic.com"]),
    (
        "codex",
        &["api.openai.com", "chatgpt.com", "auth.openai.com"],
    ),
    (
        "copilot",
        &[
            "api.githubcopilot.com",
            "*.githubcopilot.com",
            "api.github.com",
            "github.com",
        ],
    ),
    (
        "gemini",
        &[
            "generativelanguage.googleapis.com",
            "cloudcode-pa.googleapis.com",
            "oauth2.googleapis.com",
        ],
    ),
    (
        "opencode",
        &[
            "api.anthropic.com",
            "api.openai.com",
            "generativelanguage.googleapis.com",
            "models.dev",
        ],
    ),
    (
        "pi",
        &[
            "api.anthropic.com",
            "api.openai.com",
            "generativelanguage.googleapis.com",
        ],
    ),
];

/// The server's part of every agent's list, checked when the server starts.
#[derive(Debug, Clone, Default)]
pub struct EgressPolicy {
    /// `egress.allow`.
    server: AllowList,
    /// Each provider's list: built in, or replaced by the settings.
    providers: BTreeMap<String, AllowList>,
}

impl EgressPolicy {
    /// The lists of `[egress]` over the built-in ones; `known` are the provider ids this
    /// server runs (a table for another id is refused). The error names the setting.
    pub fn from_settings<'a>(
        settings: &EgressSettings,
        known: impl IntoIterator<Item = &'a str>,
    ) -> Result<Self, String> {
        let known: Vec<&str> = known.into_iter().collect();
        let server = AllowList::parse(&settings.allow)
            .map_err(|e| format!("invalid setting `egress.allow`: {e}"))?;
        let mut providers: BTreeMap<String, AllowList> = PROVIDER_DEFAULTS
            .iter()
            .map(|(id, hosts)| {
                let list = AllowList::parse(hosts).expect("the built-in lists parse");
                ((*id).to_owned(), list)
            })
            .collect();
        for (id, p) in &settings.providers {
            let setting = format!("egress.providers.{id}");
            if !known.contains(&id.as_str()) {
                return Err(format!(
                    "invalid setting `{setting}`: `{id}` is not a provider of this server"
                ));
            }
            let list = AllowList::parse(&p.allow)
                .map_err(|e| format!("invalid setting `{setting}.allow`: {e}"))?;
            providers.insert(id.clone(), list);
        }
        Ok(Self { server, providers })
    }

    /// The provider's list alone (built in or from the settings).
    pub fn provider(&self, provider: &str) -> AllowList {
        self.providers.get(provider).cloned().unwrap_or_default()
    }

    /// An agent's list: its provider's, the server's, then its team's entries. The
    /// loopback entries of the settings (with a port) are also loopback forwards of the
    /// agent's sandbox; a team's never are.
    pub fn effective(&self, provider: &str, team: &[String]) -> AllowList {
        self.list(Some(provider), team)
    }

    /// The list of a workspace's setup and teardown commands: the server's, then the
    /// team's entries (loopback forwards as in `effective`).
    pub fn for_commands(&self, team: &[String]) -> AllowList {
        self.list(None, team)
    }

    fn list(&self, provider: Option<&str>, team: &[String]) -> AllowList {
        let mut list = AllowList::default();
        if let Some(provider) = provider {
            list.forward_loopback(self.provider(provider).entries().iter().cloned());
        }
        list.forward_loopback(self.server.entries().iter().cloned());
        // Team entries were checked when they were saved; one that no longer parses
        // (a rule made stricter since) allows nothing.
        list.extend_team(team.iter().filter_map(|e| AllowEntry::parse(e).ok()));
        list
    }
}

/// The allow list of an agent of `team` running `provider`, for its egress endpoint.
#[tracing::instrument(name = "services::network::agent_allow_list", skip_all, fields(team_id = %team))]
pub async fn agent_allow_list(
    data: &Data,
    policy: &EgressPolicy,
    team: Uuid,
    provider: &str,
) -> ServiceResult<AllowList> {
    Ok(policy.effective(provider, &team_entries(data, team).await?))
}

/// The allow list of a workspace's setup or teardown commands in `team`, for the
/// endpoint of their run.
#[tracing::instrument(name = "services::network::commands_allow_list", skip_all, fields(team_id = %team))]
pub async fn commands_allow_list(
    data: &Data,
    policy: &EgressPolicy,
    team: Uuid,
) -> ServiceResult<AllowList> {
    Ok(policy.for_commands(&team_entries(data, team).await?))
}

/// The entries the team's owners set, as they are now.
async fn team_entries(data: &Data, team: Uuid) -> ServiceResult<Vec<String>> {
    Ok(store::team_network::get(&data.pool, team)
        .await?
        .map(|r| r.allow)
        .unwrap_or_default())
}

/// What a team's owners add to its agents' allow lists.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"allow": ["pypi.org", "*.pythonhosted.org", "registry.npmjs.org:443"],
    "updated_at": "2026-11-30T12:00:00Z", "updated_by": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b"}))]
pub struct TeamNetwork {
    /// Entries: `host`, `*.suffix` (subdomains only), `*` (any host that is not internal)
    /// or an IP literal (`10.0.0.7`, `[fd00::7]`), each with an optional `:port`
    /// (without one: 443 and 80).
    pub allow: Vec<String>,
    /// When the list was last set (null: never).
    pub updated_at: Option<DateTime<Utc>>,
    pub updated_by: Option<UserId>,
}

/// The new list (it replaces the old one whole).
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"allow": ["pypi.org", "*.pythonhosted.org", "registry.npmjs.org:443"]}))]
pub struct PutTeamNetwork {
    pub allow: Vec<String>,
}

impl From<Option<store::team_network::TeamNetworkRow>> for TeamNetwork {
    fn from(r: Option<store::team_network::TeamNetworkRow>) -> Self {
        match r {
            Some(r) => Self {
                allow: r.allow,
                updated_at: Some(r.updated_at),
                updated_by: r.updated_by.map(Into::into),
            },
            None => Self {
                allow: Vec::new(),
                updated_at: None,
                updated_by: None,
            },
        }
    }
}

/// The team exists and the caller may do `op` in it.
async fn team_for(
    data: &Data,
    principal: &Principal,
    team: TeamId,
    op: Operation,
) -> ServiceResult<Uuid> {
    // Visibility first: a team the caller cannot see is missing, whatever `op` needs.
    principal.authorize_in(team.uuid(), Operation::ReadTeam, "team")?;
    if store::identity::team_name(&data.pool, team.uuid())
        .await?
        .is_none()
    {
        return Err(ServiceError::NotFound("team"));
    }
    principal.authorize_in(team.uuid(), op, "team")?;
    Ok(team.uuid())
}

/// The team's entries (any member of the team, viewers too).
#[tracing::instrument(name = "services::network::get", skip_all, fields(team_id = %team))]
pub async fn get(data: &Data, principal: &Principal, team: TeamId) -> ServiceResult<TeamNetwork> {
    let team = team_for(data, principal, team, Operation::ReadTeam).await?;
    Ok(store::team_network::get(&data.pool, team).await?.into())
}

/// Check entries as a team sets them: each parses, at most `MAX_TEAM_ENTRIES`; the
/// answer is each entry in its normal spelling, repeats dropped.
pub fn check_entries(raw: &[String]) -> ServiceResult<Vec<String>> {
    if raw.len() > MAX_TEAM_ENTRIES {
        return Err(ServiceError::invalid(
            "allow",
            format!("at most {MAX_TEAM_ENTRIES} entries"),
        ));
    }
    let mut out: Vec<String> = Vec::with_capacity(raw.len());
    for (i, e) in raw.iter().enumerate() {
        let entry = AllowEntry::parse(e).map_err(|err| ServiceError::InvalidAt {
            field: format!("allow[{i}]"),
            message: err.to_string(),
        })?;
        if entry.names_loopback() {
            return Err(ServiceError::InvalidAt {
                field: format!("allow[{i}]"),
                message: format!(
                    "`{entry}`: the server's loopback is opened only by the server's settings (`egress.allow`)"
                ),
            });
        }
        let text = entry.to_string();
        if !out.contains(&text) {
            out.push(text);
        }
    }
    Ok(out)
}

/// Replace the team's entries (owners), audited in the same transaction.
#[tracing::instrument(name = "services::network::put", skip_all, fields(team_id = %team))]
pub async fn put(
    data: &Data,
    principal: &Principal,
    team: TeamId,
    body: &PutTeamNetwork,
) -> ServiceResult<TeamNetwork> {
    let team = team_for(data, principal, team, Operation::ManageTeam).await?;
    let allow = check_entries(&body.allow)?;
    let row = within_deadline(data, async {
        let mut tx = data.pool.pool().begin().await?;
        let row = store::team_network::set(&mut *tx, team, &allow, principal.user_id).await?;
        audit::record_in(
            &mut *tx,
            principal,
            &Entry::new(Action::NetworkSet, Some(team), "team", TeamId::from(team))
                .details(json!({"allow": allow})),
        )
        .await?;
        tx.commit().await?;
        Ok(row)
    })
    .await?;
    tracing::info!(team_id = %TeamId::from(team), entries = row.allow.len(), "team network allow list set");
    Ok(Some(row).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EgressProviderSettings;
    use crate::egress::Verdict;

    fn allowed(list: &AllowList, host: &str, port: u16) -> bool {
        list.check(host, port) != Verdict::Refused
    }

    #[test]
    fn an_agents_list_is_its_providers_the_servers_and_its_teams() {
        let settings = EgressSettings {
            allow: vec!["pypi.org".into()],
            ..EgressSettings::default()
        };
        let policy = EgressPolicy::from_settings(&settings, ["claude", "mock"]).unwrap();
        let list = policy.effective("claude", &["registry.npmjs.org".into()]);
        assert!(allowed(&list, "api.anthropic.com", 443));
        assert!(allowed(&list, "pypi.org", 443));
        assert!(allowed(&list, "registry.npmjs.org", 443));
        assert!(!allowed(&list, "api.openai.com", 443));
        // The mock reaches only what the server and its team add.
        let mock = policy.effective("mock", &[]);
        assert!(!allowed(&mock, "api.anthropic.com", 443));
        assert!(allowed(&mock, "pypi.org", 443));
    }

    #[test]
    fn setup_commands_get_the_servers_and_the_teams_entries_only() {
        let settings = EgressSettings {
            allow: vec!["pypi.org".into(), "127.0.0.1:9000".into()],
            ..EgressSettings::default()
        };
        let policy = EgressPolicy::from_settings(&settings, ["claude"]).unwrap();
        let list = policy.for_commands(&["registry.npmjs.org".into()]);
        assert!(allowed(&list, "pypi.org", 443));
        assert!(allowed(&list, "registry.npmjs.org", 443));
        assert!(!allowed(&list, "api.anthropic.com", 443), "no provider's");
        assert_eq!(list.forwards(), ["127.0.0.1:9000"]);
    }

    #[test]
    fn only_the_settings_loopback_entries_become_forwards() {
        let mut settings = EgressSettings {
            allow: vec!["127.0.0.1:9000".into(), "pypi.org".into()],
            ..EgressSettings::default()
        };
        settings.providers.insert(
            "claude".into(),
            EgressProviderSettings {
                allow: vec!["localhost:8080".into(), "api.anthropic.com".into()],
            },
        );
        let policy = EgressPolicy::from_settings(&settings, ["claude", "mock"]).unwrap();
        let list = policy.effective("claude", &["127.0.0.1:9100".into()]);
        assert_eq!(list.forwards(), ["localhost:8080", "127.0.0.1:9000"]);
        assert!(allowed(&list, "127.0.0.1", 9000));
        assert!(allowed(&list, "localhost", 8080));
        assert_eq!(policy.effective("mock", &[]).forwards(), ["127.0.0.1:9000"]);
    }

    #[test]
    fn a_provider_table_replaces_the_built_in_list() {
        let mut settings = EgressSettings::default();
        settings.providers.insert(
            "claude".into(),
            EgressProviderSettings {
                allow: vec!["llm-gateway.corp.example:8443".into()],
            },
        );
        let policy = EgressPolicy::from_settings(&settings, ["claude"]).unwrap();
        let list = policy.effective("claude", &[]);
        assert!(allowed(&list, "llm-gateway.corp.example", 8443));
        assert!(!allowed(&list, "api.anthropic.com", 443));
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        let settings = EgressSettings {
            allow: vec!["exa mple.com".into()],
            ..EgressSettings::default()
        };
        let e = EgressPolicy::from_settings(&settings, ["claude"]).unwrap_err();
        assert!(e.contains("`egress.allow`"), "{e}");
        let mut settings = EgressSettings::default();
        settings
            .providers
            .insert("nope".into(), EgressProviderSettings::default());
        let e = EgressPolicy::from_settings(&settings, ["claude"]).unwrap_err();
        assert!(e.contains("`egress.providers.nope`"), "{e}");
    }

    #[test]
    fn team_entries_are_normalised_and_bounded() {
        let out = check_entries(&[
            "PyPI.org.".into(),
            "pypi.org".into(),
            "*.Example.com:8443".into(),
        ])
        .unwrap();
        assert_eq!(out, ["pypi.org", "*.example.com:8443"]);
        let too_many: Vec<String> = (0..=MAX_TEAM_ENTRIES)
            .map(|i| format!("h{i}.example.com"))
            .collect();
        assert!(check_entries(&too_many).is_err());
        match check_entries(&["ok.example.com".into(), "bad host".into()]) {
            Err(ServiceError::InvalidAt { field, .. }) => assert_eq!(field, "allow[1]"),
            other => panic!("{other:?}"),
        }
        // The server's loopback is the settings' to open, never a team's.
        for e in ["127.0.0.1:5432", "localhost:8080", "[::1]:1"] {
            match check_entries(&["ok.example.com".into(), e.into()]) {
                Err(ServiceError::InvalidAt { field, message }) => {
                    assert_eq!(field, "allow[1]");
                    assert!(message.contains("egress.allow"), "{message}");
                }
                other => panic!("{e}: {other:?}"),
            }
        }
        assert!(check_entries(&["10.0.0.7:5432".into()]).is_ok());
    }
}
