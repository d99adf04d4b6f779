//! The authorization policy, in one place: every operation the API offers is one of the
//! `Operation`s below, and each states the token scope it needs and the role it needs in
//! the team the operation touches. The HTTP layer declares the operation of every route
//! in one table and checks the scope before the handler runs; services check the role
//! against the team of the resource they loaded (`Principal::authorize_in`). A team the
//! caller cannot see is reported as missing, never as forbidden.

use uuid::Uuid;

use super::AuthError;
use super::principal::{Access, Principal, Role};

/// What an operation is, for authorization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// Read a team's projects, workspaces, agents, timelines, permissions, diffs and
    /// streams, its members and the names of its secrets: a viewer, with the `read`
    /// scope.
    ReadTeam,
    /// Create and drive workspaces and agents, answer permission requests: a member,
    /// with the `agents` scope.
    DriveAgents,
    /// Projects, members, team service tokens, team secrets: an owner, with the `admin`
    /// scope. (Leaving a team yourself is allowed at any role.)
    ManageTeam,
    /// Read what only a team's owners see (its audit log): an owner, with the `read`
    /// scope.
    ReadAsOwner,
    /// Who am I, my tokens, my teams, the providers: anyone, with the `read` scope.
    ReadSelf,
    /// Create and revoke my own tokens, create a team (a user, not a service token):
    /// anyone, with the `admin` scope.
    ManageSelf,
    /// Look a user up by email to add them to a team: an owner of some team or a server
    /// admin, with the `read` scope.
    FindUsers,
    /// The server itself: users, their tokens, the cluster: a server admin, with the
    /// `admin` scope.
    AdministerServer,
}

impl Operation {
    pub const ALL: [Operation; 8] = [
        Operation::ReadTeam,
        Operation::DriveAgents,
        Operation::ManageTeam,
        Operation::ReadAsOwner,
        Operation::ReadSelf,
        Operation::ManageSelf,
        Operation::FindUsers,
        Operation::AdministerServer,
    ];

    /// What the token's scopes must allow.
    pub fn access(self) -> Access {
        match self {
            Operation::ReadTeam
            | Operation::ReadAsOwner
            | Operation::ReadSelf
            | Operation::FindUsers => Access::Read,
            Operation::DriveAgents => Access::Drive,
            Operation::ManageTeam | Operation::ManageSelf | Operation::AdministerServer => {
                Access::Manage
            }
        }
    }

    /// The role needed in the team the operation touches, when it touches one.
    pub fn role(self) -> Option<Role> {
        match self {
            Operation::ReadTeam => Some(Role::Viewer),
            Operation::DriveAgents => Some(Role::Member),
            Operation::ManageTeam | Operation::ReadAsOwner | Operation::FindUsers => {
                Some(Role::Owner)
            }
            Operation::ReadSelf | Operation::ManageSelf | Operation::AdministerServer => None,
        }
    }

    /// Whether the operation changes anything.
    pub fn mutates(self) -> bool {
        self.access() != Access::Read
    }
}

impl Principal {
    /// The token's scopes allow `op` (checked for every route before its handler runs).
    pub fn authorize(&self, op: Operation) -> Result<(), AuthError> {
        self.allow(op.access())?;
        match op {
            Operation::AdministerServer if !self.is_server_admin() => {
                Err(AuthError::Forbidden("this needs a server admin"))
            }
            Operation::FindUsers
                if !self.is_server_admin() && !self.teams.iter().any(|m| m.role == Role::Owner) =>
            {
                Err(AuthError::Forbidden(
                    "looking users up needs the owner role in a team, or a server admin",
                ))
            }
            _ => Ok(()),
        }
    }

    /// `op` in `team`: the scopes allow it and the caller's role there is high enough. A
    /// team the caller cannot see is reported as a missing `what`.
    pub fn authorize_in(
        &self,
        team: Uuid,
        op: Operation,
        what: &'static str,
    ) -> Result<(), AuthError> {
        self.authorize(op)?;
        match op.role() {
            Some(min) => self.require(team, min, what),
            None => Ok(()),
        }
    }

    /// A server admin acting as themself (a service token never is one).
    pub fn is_server_admin(&self) -> bool {
        self.is_admin && self.service_team.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Membership;

    fn principal(role: Role, scopes: &[&str]) -> (Principal, Uuid) {
        let team = Uuid::now_v7();
        let p = Principal {
            user_id: Uuid::now_v7(),
            email: "a@example.com".into(),
            name: "A".into(),
            is_admin: false,
            token_id: Uuid::now_v7(),
            service_team: None,
            teams: vec![Membership {
                team_id: team,
                team_name: "a".into(),
                role,
            }],
            scopes: scopes.iter().map(|s| s.to_string()).collect(),
            request_id: None,
            agent: None,
        };
        (p, team)
    }

    #[test]
    fn each_role_does_what_the_table_says_and_no_more() {
        use Operation::*;
        let team_ops = [ReadTeam, DriveAgents, ManageTeam, ReadAsOwner];
        let expect = [
            (Role::Viewer, [true, false, false, false]),
            (Role::Member, [true, true, false, false]),
            (Role::Owner, [true, true, true, true]),
        ];
        for (role, allowed) in expect {
            let (p, team) = principal(role, &[]);
            let got = team_ops.map(|op| p.authorize_in(team, op, "team").is_ok());
            assert_eq!(got, allowed, "{role:?}");
            // Another team is missing, whatever the role.
            for op in team_ops {
                let e = p.authorize_in(Uuid::now_v7(), op, "team").unwrap_err();
                assert_eq!(e.code(), "not_found", "{role:?} {op:?}");
            }
            assert_eq!(p.authorize(FindUsers).is_ok(), role == Role::Owner);
            assert!(p.authorize(AdministerServer).is_err());
            assert!(p.authorize(ReadSelf).is_ok() && p.authorize(ManageSelf).is_ok());
        }
    }

    #[test]
    fn a_read_token_of_an_owner_changes_nothing() {
        let (p, team) = principal(Role::Owner, &["read"]);
        for op in Operation::ALL {
            let r = p.authorize_in(team, op, "team");
            if op.mutates() {
                assert_eq!(r.unwrap_err().code(), "insufficient_scope", "{op:?}");
            }
        }
        assert!(p.authorize_in(team, Operation::ReadAsOwner, "team").is_ok());
    }

    #[test]
    fn only_a_server_admin_administers_the_server() {
        let (mut p, team) = principal(Role::Viewer, &[]);
        p.is_admin = true;
        assert!(p.authorize(Operation::AdministerServer).is_ok());
        // An admin acts as owner everywhere.
        assert!(p.authorize_in(team, Operation::ManageTeam, "team").is_ok());
        // A service token made by an admin is only a team member with its role.
        p.service_team = Some(team);
        assert!(p.authorize(Operation::AdministerServer).is_err());
        assert_eq!(
            p.authorize_in(team, Operation::ManageTeam, "team")
                .unwrap_err()
                .code(),
            "forbidden"
        );
    }
}
