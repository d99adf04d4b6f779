//! The raw reference: what the same database does with the same durable work and no
//! agentry in the path. A logged table created `LIKE agent_events` (same columns, same
//! primary key), rows shaped like the mock's `/load` chunks, batched `INSERT`s of 200 rows
//! per transaction from 2 clients, at the database's own `synchronous_commit` — the server
//! changes neither it nor `fsync`.

use std::time::{Duration, Instant};

use chrono::Utc;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::providers::mock::{load_chunk_text, unix_micros};

pub const BATCH_ROWS: usize = 200;
pub const CLIENTS: usize = 2;
/// Agents each client spreads its rows over (the writer's batches mix agents too).
const AGENTS_PER_CLIENT: usize = 25;

pub struct RawResult {
    pub rows: u64,
    pub elapsed: Duration,
    pub synchronous_commit: String,
    pub fsync: String,
    /// Average stored size of a row's `data` (bytes).
    pub data_bytes: f64,
}

impl RawResult {
    pub fn rows_per_s(&self) -> f64 {
        self.rows as f64 / self.elapsed.as_secs_f64()
    }
}

pub async fn measure(pool: &sqlx::PgPool, seconds: u64) -> anyhow::Result<RawResult> {
    sqlx::query("DROP TABLE IF EXISTS bench_raw_events")
        .execute(pool)
        .await?;
    // LIKE copies the columns, their defaults and the primary key; a plain CREATE TABLE
    // is logged (WAL, fsync at commit), unlike the TEMP table of earlier versions.
    sqlx::query("CREATE TABLE bench_raw_events (LIKE agent_events INCLUDING ALL)")
        .execute(pool)
        .await?;
    let synchronous_commit: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(pool)
        .await?;
    let fsync: String = sqlx::query_scalar("SHOW fsync").fetch_one(pool).await?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let conn = pool.acquire().await?;
        clients.push(tokio::spawn(insert_until(conn, deadline)));
    }
    let mut rows = 0;
    for c in clients {
        rows += c.await??;
    }
    let elapsed = started.elapsed();
    let data_bytes: f64 = sqlx::query_scalar(
        "SELECT coalesce(avg(pg_column_size(data)), 0)::float8 FROM
         (SELECT data FROM bench_raw_events LIMIT 10000) s",
    )
    .fetch_one(pool)
    .await?;
    sqlx::query("DROP TABLE bench_raw_events")
        .execute(pool)
        .await?;
    Ok(RawResult {
        rows,
        elapsed,
        synchronous_commit,
        fsync,
        data_bytes,
    })
}

/// One client: 200-row `INSERT`s (each its own transaction) until the deadline.
async fn insert_until(
    mut conn: sqlx::pool::PoolConnection<sqlx::Postgres>,
    deadline: Instant,
) -> anyhow::Result<u64> {
    let agents: Vec<Uuid> = (0..AGENTS_PER_CLIENT).map(|_| Uuid::now_v7()).collect();
    let turn = Uuid::now_v7();
    let message = format!("msg_{}", Uuid::now_v7().simple());
    let mut next_seq = [1i64; AGENTS_PER_CLIENT];
    let mut chunk = 0u64;
    let mut rows = 0u64;
    while Instant::now() < deadline {
        let mut ids = Vec::with_capacity(BATCH_ROWS);
        let mut seqs = Vec::with_capacity(BATCH_ROWS);
        let mut turns = Vec::with_capacity(BATCH_ROWS);
        let mut kinds = Vec::with_capacity(BATCH_ROWS);
        let mut data: Vec<Value> = Vec::with_capacity(BATCH_ROWS);
        let mut ats = Vec::with_capacity(BATCH_ROWS);
        for i in 0..BATCH_ROWS {
            let a = i % AGENTS_PER_CLIENT;
            ids.push(agents[a]);
            seqs.push(next_seq[a]);
            next_seq[a] += 1;
            turns.push(turn);
            kinds.push("assistant_delta");
            data.push(json!({
                "message_id": message,
                "text": load_chunk_text(chunk, Some(unix_micros())),
            }));
            chunk += 1;
            ats.push(Utc::now());
        }
        sqlx::query(
            "INSERT INTO bench_raw_events (agent_id, seq, turn_id, kind, data, created_at)
             SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::uuid[], $4::text[], $5::jsonb[], $6::timestamptz[])",
        )
        .bind(&ids)
        .bind(&seqs)
        .bind(&turns)
        .bind(&kinds)
        .bind(&data)
        .bind(&ats)
        .execute(&mut *conn)
        .await?;
        rows += BATCH_ROWS as u64;
    }
    Ok(rows)
}
