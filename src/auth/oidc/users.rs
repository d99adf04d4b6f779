//! From verified claims to a `Principal`: the user is upserted by (issuer, `sub`), and
//! the team memberships that `[auth.oidc.groups]` manages are set from the user's groups
//! on every authentication — a user no longer in a group loses that team at once. Teams
//! the mapping does not name are left alone (they are managed through the API).

use std::collections::BTreeMap;

use serde_json::{Map, Value};
use uuid::Uuid;

use crate::auth::{AuthError, Membership, Principal, Role};
use crate::config::OidcSettings;
use crate::store::identity::UserRow;
use crate::store::{self, DeadlinePool};

/// Who the provider says the caller is.
#[derive(Debug, Clone)]
pub struct IdpIdentity {
    pub subject: String,
    pub email: String,
    pub name: String,
    pub groups: Vec<String>,
}

impl IdpIdentity {
    pub fn from_claims(claims: &Map<String, Value>, s: &OidcSettings) -> Result<Self, AuthError> {
        let subject = claims
            .get("sub")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .ok_or(AuthError::TokenMalformed("the token has no `sub`"))?
            .to_owned();
        let text = |claim: &str| {
            claims
                .get(claim)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .chars()
                .take(320)
                .collect::<String>()
        };
        let email = text(&s.email_claim);
        let mut name = text(&s.name_claim);
        if name.is_empty() {
            name = if email.is_empty() {
                subject.clone()
            } else {
                email.clone()
            };
        }
        let groups = match claims.get(&s.groups_claim) {
            Some(Value::Array(list)) => list
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
            Some(Value::String(one)) => vec![one.clone()],
            _ => Vec::new(),
        };
        Ok(Self {
            subject,
            email,
            name,
            groups,
        })
    }
}

/// The highest mapped role per team for these groups.
fn mapped_roles(s: &OidcSettings, groups: &[String]) -> BTreeMap<String, Role> {
    let mut out: BTreeMap<String, Role> = BTreeMap::new();
    for g in groups {
        if let Some(m) = s.groups.get(g)
            && let Some(role) = Role::parse(&m.role)
        {
            let e = out.entry(m.team.clone()).or_insert(role);
            *e = (*e).max(role);
        }
    }
    out
}

/// Upsert the user, apply the group mapping, and build the caller.
pub async fn principal_for(
    pool: &DeadlinePool,
    s: &OidcSettings,
    id: &IdpIdentity,
) -> Result<Principal, AuthError> {
    let user = store::oidc::upsert_user(pool, &s.issuer, &id.subject, &id.email, &id.name).await?;
    principal_of(pool, s, user, &id.groups).await
}

/// Apply the group mapping for `groups` to a known user and build the caller.
pub(super) async fn principal_of(
    pool: &DeadlinePool,
    s: &OidcSettings,
    user: UserRow,
    groups: &[String],
) -> Result<Principal, AuthError> {
    sync_memberships(pool, s, user.id, groups).await?;
    let teams = store::identity::memberships(pool, user.id)
        .await?
        .into_iter()
        .filter_map(|m| {
            Role::parse(&m.role).map(|role| Membership {
                team_id: m.team_id,
                team_name: m.team_name,
                role,
            })
        })
        .collect();
    Ok(Principal {
        user_id: user.id,
        email: user.email,
        name: user.name,
        is_admin: user.is_admin || groups.iter().any(|g| s.admin_groups.contains(g)),
        // No API token stands behind an IdP identity.
        token_id: Uuid::nil(),
        service_team: None,
        teams,
        scopes: Vec::new(),
        request_id: None,
    })
}

/// Set the memberships of the teams the mapping names; write only what changed.
async fn sync_memberships(
    pool: &DeadlinePool,
    s: &OidcSettings,
    user: Uuid,
    groups: &[String],
) -> Result<(), AuthError> {
    if s.groups.is_empty() {
        return Ok(());
    }
    let wanted = mapped_roles(s, groups);
    let current = store::identity::memberships(pool, user).await?;
    let mut managed: Vec<&str> = s.groups.values().map(|m| m.team.as_str()).collect();
    managed.sort_unstable();
    managed.dedup();
    for team in managed {
        let have = current.iter().find(|m| m.team_name == team);
        match (wanted.get(team), have) {
            (Some(role), Some(m)) if m.role == role.as_str() => {}
            (Some(role), _) => {
                let team_id = store::oidc::ensure_team(pool, team).await?;
                store::identity::upsert_member(pool, team_id, user, role.as_str()).await?;
            }
            (None, Some(m)) => {
                store::teams::remove_member(pool, m.team_id, user).await?;
            }
            (None, None) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GroupMapping;

    #[test]
    fn several_groups_of_one_team_give_the_highest_role() {
        let mut s = OidcSettings::new("https://idp", vec!["a".into()]);
        for (g, team, role) in [
            ("eng", "platform", "viewer"),
            ("eng-leads", "platform", "owner"),
            ("ops", "ops", "member"),
        ] {
            s.groups.insert(
                g.into(),
                GroupMapping {
                    team: team.into(),
                    role: role.into(),
                },
            );
        }
        let groups = ["eng", "eng-leads", "unmapped"].map(String::from);
        let roles = mapped_roles(&s, &groups);
        assert_eq!(roles.len(), 1);
        assert_eq!(roles["platform"], Role::Owner);
    }
}
