//! Principals of API tokens held in memory: while nothing changes, a token is read from
//! the database once; what changes a principal — written through any replica or straight
//! into the database — is seen at once, and a replica that stops hearing of changes holds
//! nothing until it hears again.

use std::time::{Duration, Instant};

use reqwest::Method;
use sqlx::PgPool;

use crate::helpers::*;
use crate::metrics::{sample, scrape};
use crate::people::*;

async fn lookups(app: &TestApp, source: &str) -> f64 {
    let page = scrape(app).await;
    sample(
        &page,
        &format!("agentry_token_lookups_total{{source=\"{source}\"}}"),
    )
    .unwrap_or(0.0)
}

/// `who`'s request of `path` answers `status` within 5 s — far less than the minute a
/// principal may be held.
async fn answers_soon(who: &Caller, path: &str, status: u16) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (got, body) = who.call(Method::GET, path, None).await;
        if got == status {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{path} still answers {got} ({body}), not {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The backend of the replica's connection that listens for token changes, once there is one.
async fn listening(pool: &PgPool, not: Option<i32>) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity
             WHERE datname = current_database() AND query LIKE 'LISTEN%agentry_auth%'",
        )
        .fetch_optional(pool)
        .await
        .unwrap();
        if let Some(pid) = pid.filter(|p| Some(*p) != not) {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "nothing listens for token changes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `who` calls `path` until a call is answered from what the replica holds (the first
/// calls may come before the replica listens), within 5 s.
async fn held_after_use(app: &TestApp, who: &Caller, path: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let before = lookups(app, "held").await;
        who.ok(Method::GET, path, None, 200).await;
        if lookups(app, "held").await > before {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "every call of {path} read its token from the database"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Revoke the tokens of `email`'s user with plain SQL, as another replica or an operator would.
async fn revoke_by_sql(app: &TestApp, email: &str) {
    sqlx::query(
        "UPDATE api_tokens SET revoked_at = now()
         WHERE user_id = (SELECT id FROM users WHERE email = $1)",
    )
    .bind(email)
    .execute(&app.pool)
    .await
    .unwrap();
}

async fn sql(app: &TestApp, statement: &str) {
    sqlx::query(sqlx::AssertSqlSafe(statement.to_owned()))
        .execute(&app.pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_member_removed_or_a_token_revoked_outside_the_api_is_seen_at_once() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await;
    let cleo = person(&app, "cleo").await;
    let team_id = team(&ana, "platform").await;
    add(&ana, &team_id, &cleo, "member").await;
    listening(&app.pool, None).await;
    let team_path = format!("/v1/teams/{team_id}");
    held_after_use(&app, &cleo.api, &team_path).await;

    // As another replica, or an operator's SQL, would.
    sql(
        &app,
        "DELETE FROM team_members
         WHERE user_id = (SELECT id FROM users WHERE email = 'cleo@example.com')",
    )
    .await;
    answers_soon(&cleo.api, &team_path, 404).await;

    held_after_use(&app, &cleo.api, "/v1/me").await;
    revoke_by_sql(&app, "cleo@example.com").await;
    answers_soon(&cleo.api, "/v1/me", 401).await;
    // Ana's principal is read again too, and is unchanged.
    ana.api.ok(Method::GET, &team_path, None, 200).await;
}

#[tokio::test]
async fn a_replica_that_lost_its_listening_connection_listens_again_before_it_holds() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await;
    let first = listening(&app.pool, None).await;
    held_after_use(&app, &ana.api, "/v1/me").await;
    sql(&app, &format!("SELECT pg_terminate_backend({first})")).await;
    listening(&app.pool, Some(first)).await;
    held_after_use(&app, &ana.api, "/v1/me").await;
    revoke_by_sql(&app, "ana@example.com").await;
    answers_soon(&ana.api, "/v1/me", 401).await;
}
