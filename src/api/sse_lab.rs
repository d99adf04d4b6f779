//! The agent event stream on `actix-web-lab`'s `Sse` responder, built only with the
//! `sse-lab` feature, to measure it against the hand-framed coalescing writer of
//! `sse.rs` in `agentry bench` (issue: the stack names `actix-web-lab`). Same order,
//! replay, resync and end rules as `sse.rs`; what differs is the framing: one `sse::Event`
//! per event through the channel, each encoded and written as its own body chunk by the
//! responder, which also sends `retry:` and the keep-alive comments.

use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, Responder, get, web};
use actix_web_lab::sse::{Data, Event, Sse};
use tokio::sync::{broadcast, mpsc};

use super::error::{ApiResult, Problem};
use super::parse_id;
use super::sse::{StreamQuery, recheck, resume_point};
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::AgentId;
use crate::services::streams::{self, AgentStream, Ending, Guard};

const REPLAY_PAGE: i64 = 1000;
const STORE_RETRY: Duration = Duration::from_secs(1);

/// Every event of one agent, replayed after `Last-Event-ID` and then live.
#[utoipa::path(tag = "streams", security(("bearer" = [])), params(("id" = String, Path), StreamQuery,
    ("Last-Event-ID" = Option<String>, Header, description = "Resume after this seq")),
    responses((status = 200, content_type = "text/event-stream",
        description = "`id: <seq>`, `event: <kind>`, `data: <event JSON>` per event; `: ping` comments",
        example = "retry: 3000\n\nid: 1\nevent: status\ndata: {\"seq\":1,\"agent_id\":\"agt_…\",\"turn_id\":null,\"at\":\"2026-11-30T12:00:00Z\",\"kind\":\"status\",\"data\":{\"status\":\"starting\"}}\n\n"),
        (status = 404, body = Problem)))]
#[get("/agents/{id}/events")]
pub async fn agent_events(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    id: web::Path<String>,
    q: web::Query<StreamQuery>,
) -> ApiResult<HttpResponse> {
    let id: AgentId = parse_id(&id, "agent")?;
    let stream = streams::open_agent(&state.services, &principal, id).await?;
    let after = resume_point(&req, q.after_seq)?;
    let guard = stream.guard(recheck(&req));
    let live = stream.subscribe();
    let (tx, rx) = mpsc::channel(64);
    actix_web::rt::spawn(async move {
        if let Err(e) = pump(&stream, guard, after, live, tx).await {
            tracing::debug!(agent_id = %id, error = %e, "event stream ended");
        }
    });
    let ping = Duration::from_secs(state.settings.events.ping_interval_s);
    Ok(Sse::from_infallible_receiver(rx)
        .with_retry_duration(Duration::from_secs(3))
        .with_keep_alive(ping)
        .customize()
        .insert_header(("x-accel-buffering", "no"))
        .respond_to(&req)
        .map_into_boxed_body())
}

fn event(seq: i64, kind: &str, json: impl Into<String>) -> Event {
    Event::Data(
        Data::new(json.into())
            .id(seq.to_string())
            .event(kind.to_owned()),
    )
}

async fn pump(
    stream: &AgentStream,
    guard: Guard,
    mut last: i64,
    mut live: broadcast::Receiver<std::sync::Arc<crate::events::Published>>,
    tx: mpsc::Sender<Event>,
) -> anyhow::Result<()> {
    let revoked = guard.ended();
    tokio::pin!(revoked);
    replay(stream, &mut last, &tx).await?;
    let stopping = stream.stopping();
    tokio::pin!(stopping);
    loop {
        tokio::select! {
            _ = tx.closed() => return Ok(()),
            _ = &mut stopping => return Ok(()),
            ending = &mut revoked => return say_ended(&tx, &ending).await,
            msg = live.recv() => match msg {
                Ok(p) => {
                    let seq = p.event.seq;
                    if seq > last + 1 {
                        replay(stream, &mut last, &tx).await?;
                    }
                    if seq == last + 1 {
                        tx.send(event(seq, p.event.kind.as_str(), p.json())).await?;
                        last = seq;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    stream.fell_behind();
                    replay(stream, &mut last, &tx).await?;
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
        }
    }
}

async fn say_ended(tx: &mpsc::Sender<Event>, ending: &Ending) -> anyhow::Result<()> {
    let detail = ending.detail().replace(['\r', '\n'], " ");
    tx.send(Event::Comment(
        format!("ended {}: {detail}", ending.code()).into(),
    ))
    .await?;
    Ok(())
}

async fn replay(
    stream: &AgentStream,
    last: &mut i64,
    tx: &mpsc::Sender<Event>,
) -> anyhow::Result<()> {
    loop {
        let events = match stream.after(*last, REPLAY_PAGE).await {
            Ok(events) => events,
            Err(e) if e.is_store_unavailable() => {
                tokio::select! {
                    _ = tx.closed() => anyhow::bail!("the client left while the store was unavailable"),
                    _ = tokio::time::sleep(STORE_RETRY) => {}
                }
                tx.send(Event::Comment("store unavailable; waiting".into()))
                    .await?;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let n = events.len() as i64;
        for e in events {
            let json = serde_json::to_string(&e)?;
            tx.send(event(e.seq, e.kind.as_str(), json)).await?;
            *last = e.seq;
        }
        if n < REPLAY_PAGE {
            return Ok(());
        }
    }
}
