//! Server-Sent Event streams. Per ARCHITECTURE.md: subscribe to the bus first, replay
//! from Postgres after the client's last id, then go live, dropping anything at or below
//! the last id sent — no gaps, no duplicates, in order. Each connection has a bounded
//! buffer; when it falls behind the bus it resynchronises from the database, so a slow
//! client never slows the writer. `: ping` every `events.ping_interval_s` seconds.
//!
//! A stream lasts only as long as its caller's right to it (`streams::Guard`): when the
//! credential it was opened with is revoked or expires, or the caller loses a team the
//! stream covers, the stream sends a last comment naming why (`: ended token_revoked`)
//! and ends; reconnecting with that credential gets the refusal.

use std::time::Duration;

use actix_web::web::Bytes;
use actix_web::{HttpRequest, HttpResponse, Responder, get, http::header, web};
use actix_web_lab::sse as lab;
use serde::Deserialize;
use tokio::sync::{broadcast, mpsc};
use utoipa::IntoParams;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiError, ApiResult, Problem};
use super::parse_id;
use crate::api::AppState;
use crate::auth::Principal;
use crate::config::SseFraming;
use crate::domain::{AgentId, ProjectId, WorkspaceId};
use crate::events::TeamActivity;
use crate::services::streams::{self, AgentStream, Ending, Guard, Recheck, TeamStream, Verdict};

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(agent_events).service(team_events);
}

const REPLAY_PAGE: i64 = 1000;
const COALESCE: usize = 256;
/// What clients are told to wait before they reconnect (`retry:`).
const RETRY: Duration = Duration::from_millis(3000);
/// Events a lab-framed stream's channel holds, one to a message, where a hand-framed
/// one holds 64 chunks of up to `COALESCE` events.
const LAB_CHANNEL: usize = 1024;
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

/// A stream's way out: its task writes to it, the response body reads from it.
///
/// Framed by hand (the default), the events of a `Frames` are one text, sent as one body
/// chunk; framed by actix-web-lab's `Sse` (`SseFraming::Lab`, for the bench to measure
/// against this writer), each event goes through the channel as its own `Event`, encoded
/// and written as its own chunk by the responder, which also sends the `retry:` line.
/// Both send the same bytes.
enum Out {
    Hand(mpsc::Sender<Bytes>),
    Lab(mpsc::Sender<lab::Event>),
}

/// Events framed and not yet sent.
enum Frames {
    Hand(String),
    Lab(Vec<lab::Event>),
}

impl Out {
    /// The stream's way out and the response that reads it.
    fn open(framing: SseFraming, req: &HttpRequest) -> (Self, HttpResponse) {
        match framing {
            SseFraming::Hand => {
                let (tx, rx) = mpsc::channel(64);
                let body = futures::stream::unfold(rx, |mut rx| async move {
                    rx.recv().await.map(|b| (Ok::<_, actix_web::Error>(b), rx))
                });
                let res = HttpResponse::Ok()
                    .insert_header((header::CONTENT_TYPE, "text/event-stream"))
                    .insert_header((header::CACHE_CONTROL, "no-cache"))
                    .insert_header(("x-accel-buffering", "no"))
                    .streaming(body);
                (Self::Hand(tx), res)
            }
            SseFraming::Lab => {
                let (tx, rx) = mpsc::channel(LAB_CHANNEL);
                let res = lab::Sse::from_infallible_receiver(rx)
                    .with_retry_duration(RETRY)
                    .customize()
                    .insert_header(("x-accel-buffering", "no"))
                    .respond_to(req)
                    .map_into_boxed_body();
                (Self::Lab(tx), res)
            }
        }
    }

    fn frames(&self) -> Frames {
        match self {
            Self::Hand(_) => Frames::Hand(String::new()),
            Self::Lab(_) => Frames::Lab(Vec::new()),
        }
    }

    /// The `retry:` line every stream starts with (the lab's responder sends its own).
    async fn retry(&self) -> anyhow::Result<()> {
        if let Self::Hand(tx) = self {
            tx.send(Bytes::from_static(b"retry: 3000\n\n")).await?;
        }
        Ok(())
    }

    /// The keep-alive comment.
    async fn ping(&self) -> anyhow::Result<()> {
        match self {
            Self::Hand(tx) => tx.send(Bytes::from_static(b": ping\n\n")).await?,
            Self::Lab(tx) => tx.send(lab::Event::Comment("ping".into())).await?,
        }
        Ok(())
    }

    /// A comment of one line, sent now.
    async fn comment(&self, text: String) -> anyhow::Result<()> {
        match self {
            Self::Hand(tx) => tx.send(Bytes::from(format!(": {text}\n\n"))).await?,
            Self::Lab(tx) => tx.send(lab::Event::Comment(text.into())).await?,
        }
        Ok(())
    }

    /// Send the events of `frames`, leaving it empty.
    async fn flush(&self, frames: &mut Frames) -> anyhow::Result<()> {
        match (self, frames) {
            (Self::Hand(tx), Frames::Hand(text)) => {
                if !text.is_empty() {
                    tx.send(Bytes::from(std::mem::take(text))).await?;
                }
            }
            (Self::Lab(tx), Frames::Lab(events)) => {
                for e in events.drain(..) {
                    tx.send(e).await?;
                }
            }
            _ => unreachable!("frames are made by their stream's `Out::frames`"),
        }
        Ok(())
    }

    /// Resolves when the client has left (the response body was dropped).
    async fn closed(&self) {
        match self {
            Self::Hand(tx) => tx.closed().await,
            Self::Lab(tx) => tx.closed().await,
        }
    }
}

impl Frames {
    fn add(&mut self, id: i64, kind: &str, json: &str) {
        match self {
            Self::Hand(text) => {
                use std::fmt::Write;
                let _ = write!(text, "id: {id}\nevent: {kind}\ndata: {json}\n\n");
            }
            Self::Lab(events) => events.push(lab::Event::Data(
                lab::Data::new(json.to_owned())
                    .id(id.to_string())
                    .event(kind.to_owned()),
            )),
        }
    }
}

/// What every stream does besides its events: `retry:` once, `: ping` while idle.
struct Idle {
    ping: tokio::time::Interval,
}

impl Idle {
    async fn start(ping_interval_s: u64, out: &Out) -> anyhow::Result<Self> {
        out.retry().await?;
        let period = Duration::from_secs(ping_interval_s);
        let ping = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        Ok(Self { ping })
    }

    /// Wait until a ping is due and send it. Cancel-safe up to the send: used inside
    /// `select!`.
    async fn ping(&mut self, out: &Out) -> anyhow::Result<()> {
        self.ping.tick().await;
        out.ping().await
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
        state.services.tokens.forget_token(token.trim());
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
async fn say_ended(out: &Out, ending: &Ending) -> anyhow::Result<()> {
    let detail = ending.detail().replace(['\r', '\n'], " ");
    tracing::debug!(
        code = ending.code(),
        "stream ended: its caller lost the right to it"
    );
    out.comment(format!("ended {}: {detail}", ending.code()))
        .await
}

/// Resolves when a stream ends: its client left, or the server stops (`stopping`). Made
/// once per stream and polled in every `select!` of its loop, so an event does not
/// register (and drop) a waiter on the shutdown signal, which every stream shares.
async fn ended(out: &Out, stopping: impl std::future::Future<Output = ()>) {
    tokio::select! {
        _ = out.closed() => {}
        _ = stopping => {}
    }
}

/// Every event of one agent, replayed after `Last-Event-ID` and then live.
#[utoipa::path(tag = "streams", security(("bearer" = [])), params(("id" = String, Path), StreamQuery,
    ("Last-Event-ID" = Option<String>, Header, description = "Resume after this seq")),
    responses((status = 200, content_type = "text/event-stream",
        description = "`id: <seq>`, `event: <kind>`, `data: <event JSON>` per event; `: ping` comments",
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
    let (out, res) = Out::open(state.settings.events.sse_framing, &req);
    let ping = state.settings.events.ping_interval_s;
    actix_web::rt::spawn(async move {
        if let Err(e) = pump_agent(&stream, guard, ping, after, live, out).await {
            tracing::debug!(agent_id = %id, error = %e, "event stream ended");
        }
    });
    Ok(res)
}

async fn pump_agent(
    stream: &AgentStream,
    guard: Guard,
    ping_interval_s: u64,
    mut last: i64,
    mut live: broadcast::Receiver<std::sync::Arc<crate::events::Published>>,
    out: Out,
) -> anyhow::Result<()> {
    let revoked = guard.ended();
    tokio::pin!(revoked);
    let mut idle = Idle::start(ping_interval_s, &out).await?;
    replay_agent(stream, &mut last, &out).await?;
    let ended = ended(&out, stream.stopping());
    tokio::pin!(ended);
    loop {
        tokio::select! {
            _ = &mut ended => return Ok(()),
            ending = &mut revoked => return say_ended(&out, &ending).await,
            sent = idle.ping(&out) => sent?,
            msg = live.recv() => {
                let mut frames = out.frames();
                let mut next = Some(msg);
                let mut n = 0;
                while let Some(msg) = next.take() {
                    match msg {
                        Ok(p) => {
                            let seq = p.event.seq;
                            if seq > last + 1 {
                                // A gap: fetch what we missed from the database first.
                                out.flush(&mut frames).await?;
                                replay_agent(stream, &mut last, &out).await?;
                            }
                            if seq == last + 1 {
                                frames.add(seq, p.event.kind.as_str(), p.json());
                                last = seq;
                            }
                        }
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            stream.fell_behind();
                            out.flush(&mut frames).await?;
                            replay_agent(stream, &mut last, &out).await?;
                        }
                        Err(broadcast::error::RecvError::Closed) => {
                            out.flush(&mut frames).await?;
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
                out.flush(&mut frames).await?;
            }
        }
    }
}

/// A replay found the store unavailable: keep the stream open (a comment is its
/// keep-alive) and let the caller read again a moment later, from where it was. Ends
/// with an error only when the client has left.
async fn wait_for_store(out: &Out) -> anyhow::Result<()> {
    tokio::select! {
        _ = out.closed() => anyhow::bail!("the client left while the store was unavailable"),
        _ = tokio::time::sleep(STORE_RETRY) => {}
    }
    out.comment("store unavailable; waiting".to_owned()).await
}

/// Send every committed event after `last`, advancing it.
async fn replay_agent(stream: &AgentStream, last: &mut i64, out: &Out) -> anyhow::Result<()> {
    loop {
        let events = match stream.after(*last, REPLAY_PAGE).await {
            Ok(events) => events,
            Err(e) if e.is_store_unavailable() => {
                wait_for_store(out).await?;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let n = events.len() as i64;
        let mut frames = out.frames();
        for e in events {
            let json = serde_json::to_string(&e)?;
            frames.add(e.seq, e.kind.as_str(), &json);
            *last = e.seq;
        }
        out.flush(&mut frames).await?;
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
        description = "`id: <n>`, `event: <kind>`, `data: {\"id\", \"kind\", \"at\", \"data\"}`",
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
    let (out, res) = Out::open(state.settings.events.sse_framing, &req);
    let ping = state.settings.events.ping_interval_s;
    actix_web::rt::spawn(async move {
        if let Err(e) = pump_team(&stream, guard, ping, after, live, out).await {
            tracing::debug!(error = %e, "team stream ended");
        }
    });
    Ok(res)
}

async fn pump_team(
    stream: &TeamStream,
    guard: Guard,
    ping_interval_s: u64,
    mut last: i64,
    mut live: broadcast::Receiver<std::sync::Arc<TeamActivity>>,
    out: Out,
) -> anyhow::Result<()> {
    let revoked = guard.ended();
    tokio::pin!(revoked);
    let mut idle = Idle::start(ping_interval_s, &out).await?;
    replay_team(stream, &mut last, &out).await?;
    let ended = ended(&out, stream.stopping());
    tokio::pin!(ended);
    loop {
        tokio::select! {
            _ = &mut ended => return Ok(()),
            ending = &mut revoked => return say_ended(&out, &ending).await,
            sent = idle.ping(&out) => sent?,
            msg = live.recv() => match msg {
                Ok(a) => {
                    if a.id <= last {
                        continue;
                    }
                    if stream.admits(&a) {
                        let mut frames = out.frames();
                        frames.add(a.id, &a.kind, &serde_json::to_string(&*a)?);
                        out.flush(&mut frames).await?;
                    }
                    last = a.id;
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    stream.fell_behind();
                    replay_team(stream, &mut last, &out).await?
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
        }
    }
}

async fn replay_team(stream: &TeamStream, last: &mut i64, out: &Out) -> anyhow::Result<()> {
    loop {
        let rows = match stream.after(*last, REPLAY_PAGE).await {
            Ok(rows) => rows,
            Err(e) if e.is_store_unavailable() => {
                wait_for_store(out).await?;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let n = rows.len() as i64;
        let mut frames = out.frames();
        for a in rows {
            *last = a.id;
            if stream.admits(&a) {
                frames.add(a.id, &a.kind, &serde_json::to_string(&a)?);
            }
        }
        out.flush(&mut frames).await?;
        if n < REPLAY_PAGE {
            return Ok(());
        }
    }
}
