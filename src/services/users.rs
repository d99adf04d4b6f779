//! Users of local mode: with no identity provider, a server admin creates the people of a
//! team (and issues their first token, `identity::create_user_token`); team owners look
//! someone up by exact email to add them. With OIDC, users appear on first sign-in.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use super::audit::{self, Action, Entry};
use super::{Data, ServiceError, ServiceResult, within_deadline};
use crate::auth::{AuthError, Operation, Principal};
use crate::domain::UserId;
use crate::store;

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"email": "ana@example.com", "name": "Ana"}))]
pub struct CreateUser {
    pub email: String,
    pub name: String,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"id": "usr_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b", "email": "ana@example.com",
    "name": "Ana", "is_admin": false, "created_at": "2026-11-30T12:00:00Z"}))]
pub struct User {
    pub id: UserId,
    pub email: String,
    pub name: String,
    pub is_admin: bool,
    pub created_at: DateTime<Utc>,
}

impl From<store::teams::UserRow> for User {
    fn from(r: store::teams::UserRow) -> Self {
        Self {
            id: r.id.into(),
            email: r.email,
            name: r.name,
            is_admin: r.is_admin,
            created_at: r.created_at,
        }
    }
}

fn check_email(email: &str) -> ServiceResult<()> {
    let ok = email.len() <= 254
        && !email.chars().any(|c| c.is_whitespace() || c.is_control())
        && email
            .split_once('@')
            .is_some_and(|(local, domain)| !local.is_empty() && !domain.is_empty());
    if !ok {
        return Err(ServiceError::invalid(
            "email",
            "must be an email address (`name@domain`, at most 254 characters)",
        ));
    }
    Ok(())
}

/// A new local user (server admins only). The email is unique.
#[tracing::instrument(name = "services::users::create", skip_all)]
pub async fn create(data: &Data, principal: &Principal, body: &CreateUser) -> ServiceResult<User> {
    principal.authorize(Operation::AdministerServer)?;
    let email = body.email.trim();
    check_email(email)?;
    super::projects::validate_name("name", &body.name)?;
    let id = UserId::new();
    let row = within_deadline(data, async {
        let mut tx = data.pool.pool().begin().await?;
        let row = store::teams::insert_user(&mut *tx, id.uuid(), email, body.name.trim())
            .await?
            .ok_or(ServiceError::UserEmailTaken)?;
        audit::record_in(
            &mut *tx,
            principal,
            &Entry::new(Action::UserCreate, None, "user", id).details(json!({"email": email})),
        )
        .await?;
        tx.commit().await?;
        Ok(row)
    })
    .await?;
    Ok(row.into())
}

/// Users: a server admin lists them all (optionally the one with `email`); a team owner
/// finds one by exact email, to add them.
#[tracing::instrument(name = "services::users::list", skip_all)]
pub async fn list(
    data: &Data,
    principal: &Principal,
    email: Option<&str>,
    after: Option<UserId>,
    limit: i64,
) -> ServiceResult<Vec<User>> {
    principal.authorize(Operation::FindUsers)?;
    if !principal.is_server_admin() && email.is_none() {
        return Err(
            AuthError::Forbidden("team owners look users up by exact email: pass `email`").into(),
        );
    }
    let rows = store::teams::list_users(
        &data.pool,
        email.map(str::trim),
        after.map(|u| u.uuid()),
        limit,
    )
    .await?;
    Ok(rows.into_iter().map(User::from).collect())
}
