//! `GET /metrics`: Prometheus text for this server — requests by route template, agents,
//! turns, the event writer, streams, provider processes and the database pool. Open to
//! whoever reaches it unless `[metrics] token` is set.

use std::time::Instant;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header;
use actix_web::middleware::Next;
use actix_web::{HttpRequest, HttpResponse, get, web};
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::ApiError;
use crate::api::AppState;
use crate::metrics::{self, Counter, Family, Histogram, Page};
use crate::services::health;

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(metrics_page);
}

/// The HTTP edge's own instruments.
pub struct HttpMetrics {
    requests: Family<Counter>,
    durations: Family<Histogram>,
}

impl Default for HttpMetrics {
    fn default() -> Self {
        Self {
            requests: Family::counters(&["method", "route", "status"]),
            durations: Family::new(&["route"], || Histogram::new(metrics::SECONDS)),
        }
    }
}

/// The methods counted by name; any other (a client may send any token) counts as `other`.
const METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE",
];

/// The `method` label: a closed set, so no client can mint series.
pub fn method_label(method: &str) -> &'static str {
    METHODS
        .iter()
        .find(|m| **m == method)
        .copied()
        .unwrap_or("other")
}

/// Count every request by its route template (never the raw path: ids would make one
/// series per resource); a path no route matches counts as `unmatched`. Every label
/// comes from a closed set: the declared methods plus `other`, the server's route
/// patterns plus `unmatched`, and the status code.
pub async fn record(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let started = Instant::now();
    let method = method_label(req.method().as_str());
    let route =
        super::middleware::route_pattern(req.request()).unwrap_or_else(|| "unmatched".to_owned());
    let state = req.app_data::<web::Data<AppState>>().cloned();
    let res = next.call(req).await?;
    if let Some(state) = state {
        let status = res.status().as_u16().to_string();
        state.http.requests.with(&[method, &route, &status]).inc();
        state
            .http
            .durations
            .with(&[&route])
            .observe(started.elapsed().as_secs_f64());
    }
    Ok(res)
}

/// Prometheus text format 0.0.4.
#[utoipa::path(tag = "health",
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "Metrics in the Prometheus text format", content_type = "text/plain",
            example = "# HELP agentry_events_written_total Events committed.\n# TYPE agentry_events_written_total counter\nagentry_events_written_total 42\n"),
        (status = 401, body = crate::api::error::Problem)))]
#[get("/metrics")]
async fn metrics_page(
    state: web::Data<AppState>,
    req: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    if let Some(token) = &state.settings.metrics.token {
        let sent = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match sent {
            None => {
                return Err(ApiError::unauthorized(
                    "token_missing",
                    "send `Authorization: Bearer <metrics.token>`",
                ));
            }
            // Digests are compared, so the time taken tells nothing about the token.
            Some(s) if digest(s) != digest(token.expose()) => {
                return Err(ApiError::unauthorized(
                    "token_invalid",
                    "this is not the metrics token",
                ));
            }
            Some(_) => {}
        }
    }
    let s = &state.services;
    let mut page = Page::default();

    let agents = health::agent_counts(&s.data).await?;
    let samples: Vec<(Vec<String>, f64)> = agents
        .into_iter()
        .map(|(provider, status, n)| (vec![status, provider], n as f64))
        .collect();
    page.gauges(
        "agentry_agents",
        "Agents not archived, by status and provider (from the database).",
        &["status", "provider"],
        &samples,
    );
    page.counter_family(
        "agentry_turns_total",
        "Turns ended on this server, by provider and outcome.",
        s.fleet.agents.turns(),
    );
    page.counter_family(
        "agentry_turns_started_total",
        "Turns started on this server, by provider.",
        s.fleet.agents.turns_started(),
    );
    page.counter_family(
        "agentry_provider_sessions_total",
        "Provider processes started for agents on this server, by provider and start (new agent, or resume of a closed one: a restart).",
        s.fleet.agents.sessions(),
    );
    let writer = s.data.writer.stats();
    page.counter(
        "agentry_events_written_total",
        "Events committed by this server's writer (agent events, stand-ins included).",
        writer.committed_events,
    );
    page.counter(
        "agentry_events_rejected_total",
        "Agent events the database refused, stored as event_rejected errors instead.",
        writer.rejected_events,
    );
    page.counter(
        "agentry_fenced_batches_total",
        "Batches this server's writer refused for an agent another replica had taken over (once per agent and batch); the agent was stopped here.",
        writer.fenced_batches,
    );
    page.gauge(
        "agentry_writer_queued_events",
        "Events accepted and not yet committed.",
        writer.queued_events as f64,
    );
    page.histogram(
        "agentry_writer_batch_events",
        "Events (agent and team) per committed batch.",
        s.data.writer.batch_histogram(),
    );
    page.histogram(
        "agentry_writer_commit_seconds",
        "Time to commit one batch, retries included.",
        s.data.writer.commit_histogram(),
    );
    page.gauge(
        "agentry_sse_subscribers",
        "Open event streams (agent and team) on this server.",
        s.data.bus.subscribers() as f64,
    );
    page.counter(
        "agentry_sse_resyncs_total",
        "Streams that fell behind and caught up from the database.",
        s.data.bus.resyncs.get(),
    );
    page.counter(
        "agentry_lease_takeovers_total",
        "Agents this replica took over from a replica that stopped renewing its lease.",
        s.fleet.agents.takeovers().get(),
    );
    page.counter_family(
        "agentry_token_lookups_total",
        "API tokens resolved to their principal, by source: `held` from this replica's \
         memory, `read` from the database.",
        &s.access.tokens.lookups,
    );
    page.gauge(
        "agentry_provider_processes",
        "Agents whose provider process runs on this server now.",
        s.fleet.agents.running_processes() as f64,
    );
    let pool = s.data.pool.pool();
    let idle = pool.num_idle() as f64;
    page.gauges(
        "agentry_db_connections",
        "Database connections of this server, by state.",
        &["state"],
        &[
            (vec!["idle".into()], idle),
            (vec!["in_use".into()], f64::from(pool.size()) - idle),
        ],
    );
    // Team ids as labels: one series per team (and provider, kind), bounded by the
    // number of teams, which the server's admins create; never per agent or person.
    page.counter_family(
        "agentry_tokens_total",
        "Tokens of the turns this server recorded in the usage ledger, by team, provider and kind (input, output, cached_input; cached input is part of input).",
        &s.governance.usage.tokens,
    );
    page.counter_family_scaled(
        "agentry_cost_usd_total",
        "Cost in USD of the turns this server recorded in the usage ledger (reported by the CLI or estimated from [usage.prices]), by team and provider.",
        &s.governance.usage.cost_micro_usd,
        crate::services::usage::MICRO_USD,
    );
    page.counter_family(
        "agentry_hook_deliveries_total",
        "Hook calls and notification attempts, by outcome (delivered, retry, failed).",
        &s.hooks.deliveries,
    );
    page.counter_family(
        "agentry_http_requests_total",
        "HTTP requests, by method, route template and status.",
        &state.http.requests,
    );
    page.histogram_family(
        "agentry_http_request_duration_seconds",
        "HTTP request durations (until the response head), by route template.",
        &state.http.durations,
    );
    Ok(HttpResponse::Ok()
        .insert_header((
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        ))
        .body(page.finish()))
}

fn digest(s: &str) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, s.as_bytes())
        .as_ref()
        .to_vec()
}
