//! Server-Sent Event streams. Per ARCHITECTURE.md: subscribe to the bus first, replay
//! from Postgres after the client's last id, then go live, dropping anything at or below
//! the last id sent — no gaps, no duplicates, in order. Each connection has a bounded
//! buffer; when it falls behind the bus it resynchronises from the database, so a slow
//! client never slows the writer. `: ping` every `events.ping_interval_s` seconds.
//!
//! Once the first replay has sent everything committed when the stream opened, the
//! stream sends one `: live` comment: what follows happened after the client connected
//! (the dashboard announces only those). SSE clients ignore comments, so the contract's
//! messages are unchanged.
//!
//! A stream lasts only as long as its caller's right to it (`streams::Guard`): when the
//! credential it was opened with is revoked or expires, or the caller loses a team the
//! stream covers, the stream sends a last comment naming why (`: ended token_revoked`)
//! and ends; reconnecting with that credential gets the refusal.

use std::time::Duration;

use actix_web::web::Bytes;
use actix_web::{HttpRequest, HttpResponse, get, http::header, web};
use serde::Deserialize;
use tokio::sync::{broadcast, mpsc};
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiError, ApiResult, Problem};
use super::parse_id;
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::{AgentId, ProjectId, WorkspaceId};
use crate::events::TeamActivity;
use crate::services::streams::{self, AgentStream, Ending, Guard, Recheck, TeamStream, Verdict};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(agent_events).service(team_events);
}

const REPLAY_PAGE: i64 = 1000;
const COALESCE: usize = 256;
/// How long a stream waits before it reads again when a replay found the store down.
const STORE_RETRY: Duration = Duration::from_secs(1);

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StreamQuery {
    /// Resume after this id (the `Last-Event-ID` header wins when both are sent).
    pub after_seq: Option<i64>,
}

fn resume_point(req: &HttpRequest, query: Option<i64>) -> ApiResult<i64> {
    match req.headers().get("last-event-id") {
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .filter(|n| *n >= 0)
            .ok_or_else(|| {
                ApiError::bad_request(
                    "invalid_last_event_id",
                    "Last-Event-ID must be a non-negative integer",
                )
            }),
        None => Ok(query.unwrap_or(0).max(0)),
    }
}

fn stream_response(rx: mpsc::Receiver<Bytes>) -> HttpResponse {
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, actix_web::Error>(b), rx))
    });
    HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, "text/event-stream"))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .insert_header(("x-accel-buffering", "no"))
        .streaming(body)
}

/// The comment that marks the end of the first replay (see the module's documentation).
const LIVE: &[u8] = b": live\n\n";

/// What every stream does besides its events: `retry:` once, `: ping` while idle.
struct Idle {
    ping: tokio::time::Interval,
}

impl Idle {
    async fn start(ping_interval_s: u64, tx: &mpsc::Sender<Bytes>) -> anyhow::Result<Self> {
        tx.send(Bytes::from_static(b"retry: 3000\n\n")).await?;
        let period = Duration::from_secs(ping_interval_s);
        let ping = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        Ok(Self { ping })
    }

    /// Wait until a ping is due and send it. Cancel-safe up to the send: used inside
    /// `select!`.
    async fn ping(&mut self, tx: &mpsc::Sender<Bytes>) -> anyhow::Result<()> {
        self.ping.tick().await;
        tx.send(Bytes::from_static(b": ping\n\n")).await?;
        Ok(())
    }
}

/// Checks the credential of `req` again, as a new request carrying it would be.
/// With `fresh`, this replica's cached principal of the token is dropped first.
pub fn recheck(req: &HttpRequest) -> Recheck {
    let req = req.clone();
    Box::new(move |fresh| {
        if fresh {
            forget_bearer(&req);
        }
        let authenticated = super::auth::authenticate_request(&req);
        Box::pin(async move {
            match authenticated.await {
                Ok(p) => Verdict::Holds(p),
                Err(e) if e.status == actix_web::http::StatusCode::UNAUTHORIZED => {
                    Verdict::Refused {
                        code: e.code,
                        detail: e.detail,
                    }
                }
                Err(_) => Verdict::Unknown,
            }
        })
    })
}

/// Drop what this replica holds about the API token `req` carries, if any.
fn forget_bearer(req: &HttpRequest) {
    let Some(state) = req.app_data::<web::Data<AppState>>() else {
        return;
    };
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        });
    if let Some(token) = token {
        state.services.access.tokens.forget_token(token.trim());
    }
}

/// The answer of a `wait` whose caller lost the right to it: what a new request would get.
pub fn ending_error(ending: Ending) -> ApiError {
    match ending {
        Ending::Refused { code, detail } => {
            ApiError::new(actix_web::http::StatusCode::UNAUTHORIZED, code, detail)
        }
        Ending::OutOfScope(e) => e.into(),
    }
}

/// The last words of a stream whose caller lost the right to it.
async fn say_ended(tx: &mpsc::Sender<Bytes>, ending: &Ending) -> anyhow::Result<()> {
    let detail = ending.detail().replace(['\r', '\n'], " ");
    tracing::debug!(
        code = ending.code(),
        "stream ended: its caller lost the right to it"
    );
    tx.send(Bytes::from(format!(
        ": ended {}: {detail}\n\n",
        ending.code()
    )))
    .await?;
    Ok(())
}

/// Resolves when a stream ends: its client left, or the server stops (`stopping`). Made
/// once per stream and polled in every `select!` of its loop, so an event does not
/// register (and drop) a waiter on the shutdown signal, which every stream shares.
async fn ended(tx: &mpsc::Sender<Bytes>, stopping: impl std::future::Future<Output = ()>) {
    tokio::select! {
        _ = tx.closed() => {}
        _ = stopping => {}
    }
}

fn frame(out: &mut String, id: i64, kind: &str, json: &str) {
    use std::fmt::Write;
    let _ = write!(out, "id: {id}\nevent: {kind}\ndata: {json}\n\n");
}

/// Every event of one agent, replayed after `Last-Event-ID` and then live.
#[utoipa::path(tag = "streams", security(("bearer" = [])), params(("id" = String, Path), StreamQuery,
    ("Last-Event-ID" = Option<String>, Header, description = "Resume after this seq")),
    responses((status = 200, content_type = "text/event-stream",
        description = "`id: <seq>`, `event: <kind>`, `data: <event JSON>` per event; one `: live` comment once the replay is done; `: ping` comments",
        example = "retry: 3000\n\nid: 1\nevent: status\ndata: {\"seq\":1,\"agent_id\":\"agt_…\",\"turn_id\":null,\"at\":\"2026-11-30T12:00:00Z\",\"kind\":\"status\",\"data\":{\"status\":\"starting\"}}\n\n"),
        (status = 404, body = Problem)))]
#[get("/agents/{id}/events")]
async fn agent_events(
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
    // Subscribe before replaying, so nothing committed in between is missed.
    let live = stream.subscribe();
    let (tx, rx) = mpsc::channel(64);
    let ping = state.settings.events.ping_interval_s;
    actix_web::rt::spawn(async move {
        if let Err(e) = pump_agent(&stream, guard, ping, after, live, tx).await {
            tracing::debug!(agent_id = %id, error = %e, "event stream ended");
        }
    });
    Ok(stream_response(rx))
}

async fn pump_agent(
    stream: &AgentStream,
    guard: Guard,
    ping_interval_s: u64,
    mut last: i64,
    mut live: broadcast::Receiver<std::sync::Arc<crate::events::Published>>,
    tx: mpsc::Sender<Bytes>,
) -> anyhow::Result<()> {
    let revoked = guard.ended();
    tokio::pin!(revoked);
    let mut idle = Idle::start(ping_interval_s, &tx).await?;
    replay_agent(stream, &mut last, &tx).await?;
    tx.send(Bytes::from_static(LIVE)).await?;
    let ended = ended(&tx, stream.stopping());
    tokio::pin!(ended);
    loop {
        tokio::select! {
            _ = &mut ended => return Ok(()),
            ending = &mut revoked => return say_ended(&tx, &ending).await,
            sent = idle.ping(&tx) => sent?,
            msg = live.recv() => {
                let mut out = String::new();
                let mut next = Some(msg);
                let mut n = 0;
                while let Some(msg) = next.take() {
                    match msg {
                        Ok(p) => {
                            let seq = p.event.seq;
                            if seq > last + 1 {
                                // A gap: fetch what we missed from the database first.
                                flush(&tx, &mut out).await?;
                                replay_agent(stream, &mut last, &tx).await?;
                            }
                            if seq == last + 1 {
                                frame(&mut out, seq, p.event.kind.as_str(), p.json());
                                last = seq;
                            }
                        }
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            stream.fell_behind();
                            flush(&tx, &mut out).await?;
                            replay_agent(stream, &mut last, &tx).await?;
                        }
                        Err(broadcast::error::RecvError::Closed) => {
                            flush(&tx, &mut out).await?;
                            return Ok(());
                        }
                    }
                    n += 1;
                    if n < COALESCE {
                        next = match live.try_recv() {
                            Ok(p) => Some(Ok(p)),
                            Err(broadcast::error::TryRecvError::Lagged(k)) => Some(Err(broadcast::error::RecvError::Lagged(k))),
                            Err(_) => None,
                        };
                    }
                }
                flush(&tx, &mut out).await?;
            }
        }
    }
}

/// A replay found the store unavailable: keep the stream open (a comment is its
/// keep-alive) and let the caller read again a moment later, from where it was. Ends
/// with an error only when the client has left.
async fn wait_for_store(tx: &mpsc::Sender<Bytes>) -> anyhow::Result<()> {
    tokio::select! {
        _ = tx.closed() => anyhow::bail!("the client left while the store was unavailable"),
        _ = tokio::time::sleep(STORE_RETRY) => {}
    }
    tx.send(Bytes::from_static(b": store unavailable; waiting\n\n"))
        .await?;
    Ok(())
}

async fn flush(tx: &mpsc::Sender<Bytes>, out: &mut String) -> anyhow::Result<()> {
    if !out.is_empty() {
        tx.send(Bytes::from(std::mem::take(out))).await?;
    }
    Ok(())
}

/// Send every committed event after `last`, advancing it.
async fn replay_agent(
    stream: &AgentStream,
    last: &mut i64,
    tx: &mpsc::Sender<Bytes>,
) -> anyhow::Result<()> {
    loop {
        let events = match stream.after(*last, REPLAY_PAGE).await {
            Ok(events) => events,
            Err(e) if e.is_store_unavailable() => {
                wait_for_store(tx).await?;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let n = events.len() as i64;
        let mut out = String::new();
        for e in events {
            let json = serde_json::to_string(&e)?;
            frame(&mut out, e.seq, e.kind.as_str(), &json);
            *last = e.seq;
        }
        if !out.is_empty() {
            tx.send(Bytes::from(out)).await?;
        }
        if n < REPLAY_PAGE {
            return Ok(());
        }
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TeamStreamQuery {
    pub project_id: Option<String>,
    pub workspace_id: Option<String>,
    /// Resume after this id (the `Last-Event-ID` header wins when both are sent).
    pub after_id: Option<i64>,
}

/// The activity of your teams: agents created, status changes, permission requests and
/// answers, archives, workspaces. Resumable with `Last-Event-ID`.
#[utoipa::path(tag = "streams", security(("bearer" = [])), params(TeamStreamQuery,
    ("Last-Event-ID" = Option<String>, Header, description = "Resume after this id")),
    responses((status = 200, content_type = "text/event-stream",
        description = "`id: <n>`, `event: <kind>`, `data: {\"id\", \"kind\", \"at\", \"data\"}`; one `: live` comment once the replay is done; `: ping` comments",
        example = "id: 12\nevent: agent_status\ndata: {\"id\":12,\"kind\":\"agent_status\",\"at\":\"2026-11-30T12:00:00Z\",\"data\":{\"agent_id\":\"agt_…\",\"status\":\"running\"}}\n\n")))]
#[get("/events")]
async fn team_events(
    state: web::Data<AppState>,
    principal: Principal,
    req: HttpRequest,
    q: web::Query<TeamStreamQuery>,
) -> ApiResult<HttpResponse> {
    let project: Option<ProjectId> = q
        .project_id
        .as_deref()
        .map(|p| parse_id(p, "project"))
        .transpose()?;
    let workspace: Option<WorkspaceId> = q
        .workspace_id
        .as_deref()
        .map(|w| parse_id(w, "workspace"))
        .transpose()?;
    let stream = streams::open_team(&state.services, &principal, project, workspace).await?;
    let after = resume_point(&req, q.after_id)?;
    let guard = stream.guard(recheck(&req));
    let live = stream.subscribe();
    let (tx, rx) = mpsc::channel(64);
    let ping = state.settings.events.ping_interval_s;
    actix_web::rt::spawn(async move {
        if let Err(e) = pump_team(&stream, guard, ping, after, live, tx).await {
            tracing::debug!(error = %e, "team stream ended");
        }
    });
    Ok(stream_response(rx))
}

async fn pump_team(
    stream: &TeamStream,
    guard: Guard,
    ping_interval_s: u64,
    mut last: i64,
    mut live: broadcast::Receiver<std::sync::Arc<TeamActivity>>,
    tx: mpsc::Sender<Bytes>,
) -> anyhow::Result<()> {
    let revoked = guard.ended();
    tokio::pin!(revoked);
    let mut idle = Idle::start(ping_interval_s, &tx).await?;
    replay_team(stream, &mut last, &tx).await?;
    tx.send(Bytes::from_static(LIVE)).await?;
    let ended = ended(&tx, stream.stopping());
    tokio::pin!(ended);
    loop {
        tokio::select! {
            _ = &mut ended => return Ok(()),
            ending = &mut revoked => return say_ended(&tx, &ending).await,
            sent = idle.ping(&tx) => sent?,
            msg = live.recv() => match msg {
                Ok(a) => {
                    if a.id <= last {
                        continue;
                    }
                    if stream.admits(&a) {
                        let mut out = String::new();
                        frame(&mut out, a.id, &a.kind, &serde_json::to_string(&*a)?);
                        tx.send(Bytes::from(out)).await?;
                    }
                    last = a.id;
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    stream.fell_behind();
                    replay_team(stream, &mut last, &tx).await?
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
        }
    }
}

async fn replay_team(
    stream: &TeamStream,
    last: &mut i64,
    tx: &mpsc::Sender<Bytes>,
) -> anyhow::Result<()> {
    loop {
        let rows = match stream.after(*last, REPLAY_PAGE).await {
            Ok(rows) => rows,
            Err(e) if e.is_store_unavailable() => {
                wait_for_store(tx).await?;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let n = rows.len() as i64;
        let mut out = String::new();
        for a in rows {
            *last = a.id;
            if stream.admits(&a) {
                frame(&mut out, a.id, &a.kind, &serde_json::to_string(&a)?);
            }
        }
        if !out.is_empty() {
            tx.send(Bytes::from(out)).await?;
        }
        if n < REPLAY_PAGE {
            return Ok(());
        }
    }
}
