//! The authenticated caller and the authorization rules every service applies.

use std::future::Future;
use std::pin::Pin;

use actix_web::{FromRequest, HttpRequest, dev::Payload, http::header, web};
use chrono::Utc;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::tokens;
use crate::api::error::ApiError;
use crate::server::AppState;
use crate::store;

/// A role in a team, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Viewer,
    Member,
    Owner,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Member => "member",
            Role::Owner => "owner",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "viewer" => Some(Role::Viewer),
            "member" => Some(Role::Member),
            "owner" => Some(Role::Owner),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Membership {
    pub team_id: Uuid,
    pub team_name: String,
    pub role: Role,
}

#[derive(Debug, Clone)]
pub struct Principal {
    pub user_id: Uuid,
    pub email: String,
    pub name: String,
    /// A server admin sees and may act on every team.
    pub is_admin: bool,
    pub token_id: Uuid,
    /// Set for a team service token: it acts only in that team, with that role.
    pub service_team: Option<Uuid>,
    pub teams: Vec<Membership>,
}

impl Principal {
    /// Team ids whose resources the caller may see; `None` means every team.
    pub fn visible_teams(&self) -> Option<Vec<Uuid>> {
        if self.is_admin && self.service_team.is_none() {
            None
        } else {
            Some(self.teams.iter().map(|m| m.team_id).collect())
        }
    }

    pub fn role_in(&self, team: Uuid) -> Option<Role> {
        if self.is_admin && self.service_team.is_none() {
            return Some(Role::Owner);
        }
        self.teams
            .iter()
            .find(|m| m.team_id == team)
            .map(|m| m.role)
    }

    /// The caller may act in `team` with at least `min`. A team the caller cannot see is
    /// reported as a missing resource, never as forbidden.
    pub fn require(&self, team: Uuid, min: Role, what: &str) -> Result<(), ApiError> {
        match self.role_in(team) {
            None => Err(ApiError::not_found(what)),
            Some(r) if r < min => Err(ApiError::forbidden(format!(
                "this needs the {} role in the team; you are {}",
                min.as_str(),
                r.as_str()
            ))),
            Some(_) => Ok(()),
        }
    }

    /// The team new resources go to when the request names none.
    pub fn default_team(&self) -> Option<Uuid> {
        self.service_team
            .or_else(|| self.teams.first().map(|m| m.team_id))
    }

    /// Identity used to scope idempotency keys.
    pub fn idempotency_scope(&self) -> String {
        format!(
            "{}:{}",
            self.user_id,
            self.service_team.map(|t| t.to_string()).unwrap_or_default()
        )
    }
}

const MAX_TOKEN_BYTES: usize = 16 * 1024;

impl FromRequest for Principal {
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Result<Self, Self::Error>>>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let state = req.app_data::<web::Data<AppState>>().cloned();
        let header = req
            .headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes().to_vec());
        Box::pin(async move {
            let state =
                state.ok_or_else(|| ApiError::internal(anyhow::anyhow!("app state missing")))?;
            let raw = header.ok_or_else(|| {
                ApiError::unauthorized("token_missing", "send `Authorization: Bearer <token>`")
            })?;
            if raw.len() > MAX_TOKEN_BYTES + 7 {
                return Err(ApiError::unauthorized(
                    "token_too_large",
                    "the token is larger than 16 KiB",
                ));
            }
            let raw = std::str::from_utf8(&raw).map_err(|_| {
                ApiError::unauthorized("token_malformed", "the Authorization header is not text")
            })?;
            let token = raw
                .strip_prefix("Bearer ")
                .or_else(|| raw.strip_prefix("bearer "))
                .map(str::trim)
                .ok_or_else(|| {
                    ApiError::unauthorized(
                        "token_malformed",
                        "expected `Authorization: Bearer <token>`",
                    )
                })?;
            authenticate(&state, token).await
        })
    }
}

/// Resolve a bearer token to a principal.
pub async fn authenticate(state: &AppState, token: &str) -> Result<Principal, ApiError> {
    if !tokens::well_formed(token) {
        return Err(ApiError::unauthorized(
            "token_malformed",
            "this is not an agentry API token",
        ));
    }
    let row = store::identity::token_by_hash(&state.pool, &tokens::hash(token))
        .await?
        .ok_or_else(|| ApiError::unauthorized("token_invalid_signature", "unknown token"))?;
    if row.revoked_at.is_some() {
        return Err(ApiError::unauthorized(
            "token_revoked",
            "this token was revoked",
        ));
    }
    if row.expires_at.is_some_and(|t| t <= Utc::now()) {
        return Err(ApiError::unauthorized(
            "token_expired",
            "this token has expired",
        ));
    }
    let user = store::identity::get_user(&state.pool, row.user_id)
        .await?
        .ok_or_else(|| {
            ApiError::unauthorized("token_revoked", "the token's user no longer exists")
        })?;
    let teams = match (row.team_id, row.role.as_deref().and_then(Role::parse)) {
        (Some(team_id), Some(role)) => {
            let team_name = store::identity::team_name(&state.pool, team_id)
                .await?
                .unwrap_or_default();
            vec![Membership {
                team_id,
                team_name,
                role,
            }]
        }
        _ => store::identity::memberships(&state.pool, user.id)
            .await?
            .into_iter()
            .filter_map(|m| {
                Role::parse(&m.role).map(|role| Membership {
                    team_id: m.team_id,
                    team_name: m.team_name,
                    role,
                })
            })
            .collect(),
    };
    let pool = state.pool.clone();
    let token_id = row.id;
    state.runtime.spawn(async move {
        if let Err(e) = store::identity::touch_token(&pool, token_id).await {
            tracing::debug!(error = %e, "could not record token use");
        }
    });
    Ok(Principal {
        user_id: user.id,
        email: user.email,
        name: user.name,
        is_admin: user.is_admin,
        token_id: row.id,
        service_team: row.team_id,
        teams,
    })
}
