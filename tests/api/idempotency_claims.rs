//! Idempotency claims of requests that died mid-way (claimed, no response stored) expire,
//! so a retry with the same key works; answered keys never do.

use agentry::store::idempotency as keys;
use serde_json::json;
use sqlx::PgPool;

use crate::helpers::{fresh_database, git_repo, spawn_app, spawn_on};

async fn age(pool: &PgPool, key: &str, seconds: i64) {
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = now() - make_interval(secs => $2) WHERE key = $1",
    )
    .bind(key)
    .bind(seconds as f64)
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn an_abandoned_claim_expires_and_an_answered_key_does_not() {
    let pool = agentry::store::connect(fresh_database().await, 2)
        .await
        .unwrap();
    agentry::store::migrate(&pool).await.unwrap();
    let (who, key) = ("usr_1:/v1/agents", "k-1");

    assert!(keys::claim(&pool, who, key, b"h1").await.unwrap());
    assert!(
        !keys::claim(&pool, who, key, b"h1").await.unwrap(),
        "a fresh claim holds its key"
    );
    age(&pool, key, keys::CLAIM_TTL_S - 5).await;
    assert!(
        !keys::claim(&pool, who, key, b"h1").await.unwrap(),
        "still held just before the bound"
    );

    // The request died: past the bound, a retry takes the key over, with its own body.
    age(&pool, key, keys::CLAIM_TTL_S + 1).await;
    assert!(keys::claim(&pool, who, key, b"h2").await.unwrap());
    let row = keys::get(&pool, who, key).await.unwrap().unwrap();
    assert_eq!(row.request_hash, b"h2");
    assert_eq!(row.response, None);
    assert!(
        !keys::claim(&pool, who, key, b"h2").await.unwrap(),
        "the take-over is a fresh claim"
    );

    // An answered key keeps its response however old it is.
    keys::complete(&pool, who, key, 201, &json!({"id": "agt_1"}))
        .await
        .unwrap();
    age(&pool, key, 10 * keys::CLAIM_TTL_S).await;
    assert!(!keys::claim(&pool, who, key, b"h3").await.unwrap());
    let row = keys::get(&pool, who, key).await.unwrap().unwrap();
    assert_eq!(row.response, Some(json!({"id": "agt_1"})));
    assert_eq!(row.request_hash, b"h2");

    // Other principals' keys are separate.
    assert!(
        keys::claim(&pool, "usr_2:/v1/agents", key, b"h1")
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn claims_left_by_a_stopped_server_are_released_at_boot() {
    let app = spawn_app().await;
    let repo = git_repo();
    // A create that answered, and one that died with the server (claimed, no response).
    let res = app
        .client
        .post(app.url("/v1/projects"))
        .bearer_auth(&app.token)
        .header("Idempotency-Key", "done")
        .json(&json!({"name": "kept", "repo_path": repo.path()}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    sqlx::query(
        "INSERT INTO idempotency_keys (principal, key, request_hash) VALUES ('someone', 'died', '\\x00')",
    )
    .execute(&app.pool)
    .await
    .unwrap();

    let (db, dir, token) = app.stop().await;
    let app = spawn_on(db, dir, Some(token)).await;
    let left: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_keys ORDER BY key")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(left, ["done"]);
}
