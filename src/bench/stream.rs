//! One SSE subscriber of one agent: checks every event as it arrives (seq dense from 1,
//! `/load` chunks dense from 0 within their turn), and measures each stamped chunk's
//! emission→arrival latency against the mock's stamp (same machine, same clock).

use std::borrow::Cow;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tokio::sync::watch;

use super::client::SseStream;
use super::verify::{Dense, Seen};
use crate::providers::mock::{parse_load_chunk, unix_micros};

/// When a subscriber stops reading.
pub enum Until {
    /// At the `turn_completed` of the first `/load` turn (which must complete).
    LoadTurn,
    /// Once it has received the seq the receiver holds (set when it is known).
    Seq(watch::Receiver<i64>),
}

pub struct Subscription {
    pub agent: String,
    pub seen: Seen,
    /// Events received with a seq above `from_seq` (the measured window).
    pub window_events: u64,
    /// Every stamped chunk: its emission stamp, its emission→arrival time, and the part of
    /// it before the server's writer took it into a batch (the event's `at`), all in
    /// microseconds.
    pub latencies_us: Vec<(i64, u32, u32)>,
    pub finished: Instant,
    /// The connection, still open: a subscriber hangs up only when its owner drops it, so
    /// a load's subscribers stay connected, as a dashboard would, until all have finished
    /// (1,000 hang-ups at the turns' end would be work in the measured window that no
    /// watching client causes).
    pub connection: SseStream,
}

#[derive(Deserialize)]
struct Envelope<'a> {
    seq: i64,
    #[serde(borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    turn_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    at: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    data: Data<'a>,
}

#[derive(Deserialize, Default)]
struct Data<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    outcome: Option<Cow<'a, str>>,
}

/// The longest the stream may stay silent (the server pings every 15 s).
const SILENCE: Duration = Duration::from_secs(40);

pub async fn read(
    mut stream: SseStream,
    agent: String,
    from_seq: i64,
    mut until: Until,
) -> anyhow::Result<Subscription> {
    let fail = |what: String| anyhow::anyhow!("agent {agent}: a subscriber {what}");
    let mut seqs = Dense::starting_at(1);
    let mut chunks = Dense::starting_at(0);
    let mut load_turn: Option<String> = None;
    let mut load_chunks = 0u64;
    let mut window_events = 0u64;
    let mut latencies_us = Vec::new();
    loop {
        let frames = match &mut until {
            Until::Seq(target) => {
                if seqs.last() >= *target.borrow() {
                    break;
                }
                tokio::select! {
                    frames = stream.next_chunk(SILENCE) => frames?,
                    changed = target.changed() => {
                        changed.map_err(|_| fail("was never told where to stop".into()))?;
                        continue;
                    }
                }
            }
            Until::LoadTurn => stream.next_chunk(SILENCE).await?,
        };
        let Some(frames) = frames else {
            return Err(fail(format!(
                "saw the stream end after seq {}",
                seqs.last()
            )));
        };
        let now_us = unix_micros();
        let mut done = false;
        for frame in &frames {
            let ev: Envelope<'_> = serde_json::from_slice(frame)
                .map_err(|e| fail(format!("got an event it cannot read: {e}")))?;
            seqs.push(ev.seq).map_err(|e| fail(format!("saw a {e}")))?;
            if ev.seq > from_seq {
                window_events += 1;
            }
            let in_load_turn =
                ev.turn_id.is_some() && ev.turn_id.as_deref() == load_turn.as_deref();
            match &*ev.kind {
                "user_message"
                    if ev
                        .data
                        .text
                        .as_deref()
                        .is_some_and(|t| t.starts_with("/load")) =>
                {
                    load_turn = ev.turn_id.map(Cow::into_owned);
                    chunks = Dense::starting_at(0);
                }
                "assistant_delta" if in_load_turn => {
                    let text = ev.data.text.as_deref().unwrap_or_default();
                    let (i, stamp) = parse_load_chunk(text)
                        .ok_or_else(|| fail(format!("got a chunk it cannot read: {text:?}")))?;
                    chunks
                        .push(i as i64)
                        .map_err(|e| fail(format!("saw a load chunk {e}")))?;
                    load_chunks += 1;
                    if let Some(stamp) = stamp {
                        let at_us = ev
                            .at
                            .as_deref()
                            .and_then(|a| chrono::DateTime::parse_from_rfc3339(a).ok())
                            .ok_or_else(|| fail("got an event without a readable `at`".into()))?
                            .timestamp_micros();
                        let us = |d: i64| d.clamp(0, u32::MAX as i64) as u32;
                        latencies_us.push((stamp, us(now_us - stamp), us(at_us - stamp)));
                    }
                }
                "turn_completed" if in_load_turn => {
                    let outcome = ev.data.outcome.as_deref().unwrap_or_default();
                    if outcome != "completed" {
                        return Err(fail(format!("saw the load turn end `{outcome}`")));
                    }
                    if matches!(until, Until::LoadTurn) {
                        done = true;
                    }
                }
                _ => {}
            }
            // Stop exactly there, so every subscriber of an agent ends on the same seq.
            if let Until::Seq(target) = &until {
                done = seqs.last() >= *target.borrow();
            }
            if done {
                break;
            }
        }
        if done {
            break;
        }
    }
    Ok(Subscription {
        agent,
        seen: Seen {
            last_seq: seqs.last(),
            load_chunks,
        },
        window_events,
        latencies_us,
        finished: Instant::now(),
        connection: stream,
    })
}
