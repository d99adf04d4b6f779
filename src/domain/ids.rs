//! Typed identifiers. Every id is a UUIDv7 inside; on the wire it is shown with a type
//! prefix (`agt_…`, `wsp_…`) so a client can never pass a workspace id where an agent id
//! is expected.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use uuid::Uuid;

/// A wire id that failed to parse: wrong prefix, or not a UUID after it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("malformed id `{0}`")]
pub struct MalformedId(pub String);

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub Uuid);

        impl $name {
            pub const PREFIX: &'static str = $prefix;

            /// A fresh, time-ordered id.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }

            pub fn uuid(&self) -> Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl From<Uuid> for $name {
            fn from(u: Uuid) -> Self {
                Self(u)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}{}", $prefix, self.0.simple())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }

        impl FromStr for $name {
            type Err = MalformedId;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                let rest = s.strip_prefix($prefix).ok_or_else(|| MalformedId(s.to_owned()))?;
                if rest.len() != 32 {
                    return Err(MalformedId(s.to_owned()));
                }
                Uuid::try_parse(rest).map(Self).map_err(|_| MalformedId(s.to_owned()))
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }

        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .pattern(Some(concat!("^", $prefix, "[0-9a-f]{32}$")))
                    .examples([serde_json::json!(concat!($prefix, "0193a1b2c3d47e8f9a0b1c2d3e4f5a6b"))])
                    .into()
            }
        }

        impl utoipa::ToSchema for $name {}
    };
}

typed_id!(
    /// A person (or the local admin).
    UserId, "usr_"
);
typed_id!(
    /// A team: the unit of ownership and visibility.
    TeamId, "team_"
);
typed_id!(
    /// A git repository registered on the server.
    ProjectId, "prj_"
);
typed_id!(
    /// A worktree or directory an agent works in.
    WorkspaceId, "wsp_"
);
typed_id!(
    /// One agent: a provider session with a durable timeline.
    AgentId, "agt_"
);
typed_id!(
    /// One prompt and everything the agent did for it.
    TurnId, "trn_"
);
typed_id!(
    /// A permission request raised by an agent.
    PermissionId, "perm_"
);
typed_id!(
    /// An API token.
    TokenId, "tok_"
);
typed_id!(
    /// An entry of the audit log.
    AuditId, "aud_"
);
typed_id!(
    /// A lifecycle hook (a webhook).
    HookId, "hook_"
);
typed_id!(
    /// A trigger: a webhook receiver or a schedule that starts or continues agents.
    TriggerId, "trg_"
);
typed_id!(
    /// One run of a trigger: a delivery it received or a schedule slot.
    TriggerRunId, "trun_"
);
typed_id!(
    /// One delivery of a hook notification (the same id on every retry).
    DeliveryId, "dlv_"
);
typed_id!(
    /// A user or assistant message inside a timeline.
    MessageId, "msg_"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_wrong_prefix() {
        let id = AgentId::new();
        let s = id.to_string();
        assert!(s.starts_with("agt_"));
        assert_eq!(s.parse::<AgentId>().unwrap(), id);
        assert!(s.replace("agt_", "wsp_").parse::<AgentId>().is_err());
        assert!("agt_../../etc".parse::<AgentId>().is_err());
        assert!("agt_".parse::<AgentId>().is_err());
    }
}
