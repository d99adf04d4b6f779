//! API token issuance.

use actix_web::http::StatusCode;
use chrono::{Duration, Utc};

use crate::api::error::{ApiError, ApiResult};
use crate::api::identity::{CreateToken, CreatedToken};
use crate::auth::{Principal, Role, tokens};
use crate::store;

pub async fn create(
    state: &crate::server::AppState,
    principal: &Principal,
    body: &CreateToken,
) -> ApiResult<(StatusCode, CreatedToken)> {
    let name = body.name.trim();
    if name.is_empty() || name.len() > 100 {
        return Err(ApiError::validation("name", "must be 1 to 100 characters"));
    }
    if let Some(d) = body.expires_in_days
        && !(1..=3650).contains(&d)
    {
        return Err(ApiError::validation(
            "expires_in_days",
            "must be between 1 and 3650",
        ));
    }
    let (team, role) = match body.team_id {
        Some(team) => {
            principal.require(team.uuid(), Role::Owner, "team")?;
            let role = body.role.unwrap_or(Role::Member);
            if principal
                .role_in(team.uuid())
                .is_some_and(|mine| role > mine)
            {
                return Err(ApiError::forbidden(
                    "a service token cannot have a higher role than yours",
                ));
            }
            (Some(team.uuid()), Some(role))
        }
        None if body.role.is_some() => {
            return Err(ApiError::validation(
                "role",
                "only a team service token has a role",
            ));
        }
        None => (principal.service_team, None),
    };
    let token = tokens::generate();
    let expires_at = body
        .expires_in_days
        .map(|d| Utc::now() + Duration::days(i64::from(d)));
    let row = store::identity::insert_token(
        &state.pool,
        uuid::Uuid::now_v7(),
        principal.user_id,
        team,
        role.map(Role::as_str),
        name,
        &tokens::shown_prefix(&token),
        &tokens::hash(&token),
        &body.scopes,
        expires_at,
    )
    .await?;
    Ok((
        StatusCode::CREATED,
        CreatedToken {
            id: row.id.into(),
            name: row.name,
            token,
            prefix: row.prefix,
            expires_at: row.expires_at,
        },
    ))
}
