//! What the bench checks before it reports a figure: every subscriber saw each agent's
//! events 1..N in order with no gap and no duplicate, every `/load` chunk arrived once and
//! in order, and the database holds every delivered event (count and per-agent max seq).

use std::collections::HashMap;

use sqlx::PgPool;
use uuid::Uuid;

/// Expects a dense run of numbers: `first`, `first + 1`, …
#[derive(Debug, Clone)]
pub struct Dense {
    next: i64,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DenseError {
    #[error("gap: expected {expected}, got {got}")]
    Gap { expected: i64, got: i64 },
    #[error("duplicate or out of order: expected {expected}, got {got}")]
    Repeat { expected: i64, got: i64 },
}

impl Dense {
    pub fn starting_at(first: i64) -> Self {
        Self { next: first }
    }

    pub fn push(&mut self, got: i64) -> Result<(), DenseError> {
        let expected = self.next;
        match got.cmp(&expected) {
            std::cmp::Ordering::Equal => {
                self.next += 1;
                Ok(())
            }
            std::cmp::Ordering::Greater => Err(DenseError::Gap { expected, got }),
            std::cmp::Ordering::Less => Err(DenseError::Repeat { expected, got }),
        }
    }

    /// The last number pushed (`first - 1` when none).
    pub fn last(&self) -> i64 {
        self.next - 1
    }
}

/// What one subscriber saw of one agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// The last seq it received; it received every seq from 1 to this one.
    pub last_seq: i64,
    /// `/load` chunks it received (each index once, in order).
    pub load_chunks: u64,
}

/// What the database holds for one agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Stored {
    pub rows: i64,
    pub max_seq: i64,
    pub deltas: i64,
}

/// Check one agent: its timeline in the database is dense from 1, holds everything the
/// subscribers saw, and every subscriber saw the same events, including all `expected`
/// load chunks (when given).
pub fn check_agent(
    agent: &str,
    stored: Option<Stored>,
    seen: &[Seen],
    expected_chunks: Option<u64>,
) -> Result<(), String> {
    let stored = stored.ok_or_else(|| format!("agent {agent}: no event in the database"))?;
    if stored.rows != stored.max_seq {
        return Err(format!(
            "agent {agent}: the database holds {} events but its highest seq is {}",
            stored.rows, stored.max_seq
        ));
    }
    let Some(first) = seen.first() else {
        return Err(format!("agent {agent}: no subscriber"));
    };
    for s in seen {
        if s != first {
            return Err(format!(
                "agent {agent}: subscribers disagree: {first:?} against {s:?}"
            ));
        }
    }
    if first.last_seq > stored.max_seq {
        return Err(format!(
            "agent {agent}: delivered up to seq {} but the database ends at {}",
            first.last_seq, stored.max_seq
        ));
    }
    if let Some(expected) = expected_chunks {
        if first.load_chunks != expected {
            return Err(format!(
                "agent {agent}: a subscriber received {} of {expected} load chunks",
                first.load_chunks
            ));
        }
        if stored.deltas != expected as i64 {
            return Err(format!(
                "agent {agent}: the database holds {} of {expected} load chunks",
                stored.deltas
            ));
        }
    }
    Ok(())
}

/// Check every agent against the database; the first failure is an error naming the
/// agent. `seen` maps an agent id (`agt_…`) to what each of its subscribers saw.
pub async fn check_durable(
    pool: &PgPool,
    seen: &HashMap<String, Vec<Seen>>,
    expected_chunks: Option<u64>,
) -> anyhow::Result<i64> {
    let mut ids = Vec::with_capacity(seen.len());
    for agent in seen.keys() {
        ids.push(agent_uuid(agent)?);
    }
    let rows: Vec<(Uuid, i64, i64, i64)> = sqlx::query_as(
        "SELECT agent_id, count(*), max(seq), count(*) FILTER (WHERE kind = 'assistant_delta')
         FROM agent_events WHERE agent_id = ANY($1) GROUP BY agent_id",
    )
    .bind(&ids)
    .fetch_all(pool)
    .await?;
    let stored: HashMap<Uuid, Stored> = rows
        .into_iter()
        .map(|(id, rows, max_seq, deltas)| {
            (
                id,
                Stored {
                    rows,
                    max_seq,
                    deltas,
                },
            )
        })
        .collect();
    let mut total = 0;
    for (agent, subs) in seen {
        let s = stored.get(&agent_uuid(agent)?).copied();
        check_agent(agent, s, subs, expected_chunks).map_err(anyhow::Error::msg)?;
        total += s.map_or(0, |s| s.rows);
    }
    Ok(total)
}

pub fn agent_uuid(agent: &str) -> anyhow::Result<Uuid> {
    let hex = agent
        .strip_prefix("agt_")
        .ok_or_else(|| anyhow::anyhow!("not an agent id: {agent}"))?;
    Ok(Uuid::parse_str(hex)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_accepts_a_run_and_names_gaps_and_repeats() {
        let mut d = Dense::starting_at(1);
        for s in 1..=5 {
            d.push(s).unwrap();
        }
        assert_eq!(d.last(), 5);
        assert_eq!(
            d.push(7),
            Err(DenseError::Gap {
                expected: 6,
                got: 7
            })
        );
        assert_eq!(
            d.push(5),
            Err(DenseError::Repeat {
                expected: 6,
                got: 5
            })
        );
        assert_eq!(
            d.push(3),
            Err(DenseError::Repeat {
                expected: 6,
                got: 3
            })
        );
        d.push(6).unwrap();
        let mut chunks = Dense::starting_at(0);
        assert!(chunks.push(1).is_err(), "chunk 0 is missing");
    }

    fn stored(rows: i64, max_seq: i64, deltas: i64) -> Option<Stored> {
        Some(Stored {
            rows,
            max_seq,
            deltas,
        })
    }

    fn seen(last_seq: i64, load_chunks: u64) -> Seen {
        Seen {
            last_seq,
            load_chunks,
        }
    }

    #[test]
    fn an_agent_passes_only_when_the_database_holds_what_was_delivered() {
        let ok = [seen(105, 100), seen(105, 100)];
        assert_eq!(
            check_agent("a", stored(106, 106, 100), &ok, Some(100)),
            Ok(())
        );
        // Rows missing in the middle of the timeline.
        assert!(check_agent("a", stored(105, 106, 100), &ok, Some(100)).is_err());
        // Delivered beyond what is stored.
        assert!(check_agent("a", stored(104, 104, 100), &ok, Some(100)).is_err());
        // A chunk lost before the database, or before a subscriber.
        assert!(check_agent("a", stored(106, 106, 99), &ok, Some(100)).is_err());
        assert!(
            check_agent(
                "a",
                stored(106, 106, 100),
                &[seen(105, 100), seen(105, 99)],
                Some(100)
            )
            .is_err()
        );
        // Two subscribers that stopped at different points.
        assert!(
            check_agent(
                "a",
                stored(106, 106, 100),
                &[seen(105, 100), seen(104, 100)],
                None
            )
            .is_err()
        );
        assert!(check_agent("a", None, &ok, None).is_err());
        assert!(check_agent("a", stored(1, 1, 0), &[], None).is_err());
    }
}
