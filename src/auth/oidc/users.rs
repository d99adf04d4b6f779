//! From verified claims to a `Principal`: the user is upserted by (issuer, `sub`), and
//! the team memberships that `[auth.oidc.groups]` manages are set from the user's groups
//! on every authentication — a user no longer in a group loses that team at once. Teams
//! the mapping does not name are left alone (they are managed through the API).
//!
//! A mapped team is bound to its mapping by a key the server records when it makes the
//! team (`mapping_key`: the issuer and the mapped team's name), never found by name: a
//! team someone made through the API is never a mapped team, whatever it is called.
//! The email is used to find people only when the provider verified it
//! (`email_verified: true`, or `assume_email_verified`).

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
    /// The provider says it verified `email` (`email_verified: true`, or every address
    /// when `assume_email_verified` is set).
    pub email_verified: bool,
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
        let email_verified = !email.is_empty()
            && match claims.get("email_verified") {
                Some(Value::Bool(b)) => *b,
                // Some providers send it as a string.
                Some(Value::String(v)) => v == "true",
                Some(_) => false,
                None => s.assume_email_verified,
            };
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
            email_verified,
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
    let user = store::oidc::upsert_user(
        pool,
        &s.issuer,
        &id.subject,
        &id.email,
        id.email_verified,
        &id.name,
    )
    .await?;
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
        agent: None,
    })
}

/// The key that binds the team `team` of the group mapping of `issuer` to the team the
/// server made for it.
pub fn mapping_key(issuer: &str, team: &str) -> String {
    format!("oidc:{issuer}#{team}")
}

/// Set the memberships of the teams the mapping names (found by their key, never by
/// name); write only what changed. A mapped team is made when someone first joins it.
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
    let keys: Vec<String> = managed.iter().map(|t| mapping_key(&s.issuer, t)).collect();
    let bound = store::oidc::mapped_teams(pool, &keys).await?;
    for (team, key) in managed.into_iter().zip(&keys) {
        let team_id = bound.iter().find(|(k, _)| k == key).map(|(_, id)| *id);
        let have = team_id.and_then(|id| current.iter().find(|m| m.team_id == id));
        match (wanted.get(team), have) {
            (Some(role), Some(m)) if m.role == role.as_str() => {}
            (Some(role), _) => {
                let team_id = match team_id {
                    Some(id) => id,
                    None => store::oidc::ensure_mapped_team(pool, key, team).await?,
                };
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

/// The names `[auth.oidc.groups]` gives its teams: reserved, nobody creates a team of
/// one of them through the API.
pub fn reserved_team_names(s: &OidcSettings) -> impl Iterator<Item = &str> {
    s.groups.values().map(|m| m.team.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GroupMapping;

    #[test]
    fn only_an_email_the_provider_verified_counts_as_verified() {
        let mut s = OidcSettings::new("https://idp", vec!["a".into()]);
        let verified = |s: &OidcSettings, extra: Value| {
            let mut claims = serde_json::json!({"sub": "u1", "email": "u1@example.com"});
            if let Value::Object(more) = extra {
                claims.as_object_mut().unwrap().extend(more);
            }
            let Value::Object(claims) = claims else {
                unreachable!()
            };
            IdpIdentity::from_claims(&claims, s).unwrap().email_verified
        };
        use serde_json::json;
        assert!(!verified(&s, json!({})), "a missing claim is unverified");
        assert!(!verified(&s, json!({"email_verified": false})));
        assert!(!verified(&s, json!({"email_verified": "yes"})));
        assert!(verified(&s, json!({"email_verified": true})));
        assert!(verified(&s, json!({"email_verified": "true"})));
        s.assume_email_verified = true;
        assert!(
            verified(&s, json!({})),
            "the setting vouches for every address"
        );
        assert!(
            !verified(&s, json!({"email_verified": false})),
            "but not against the claim"
        );
    }

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
