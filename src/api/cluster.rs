//! Several replicas: `GET /v1/cluster`, and the hand-over of agent commands. A command for
//! an agent another replica runs (prompt, interrupt, permission answer, mode, model,
//! close, archive, and the long `wait`) is sent on to that replica with the caller's own
//! credentials — a bearer token, or a dashboard's session cookie with the `Origin` (or
//! `Referer`) its CSRF check reads; no other cookie is passed on — and its answer is the
//! answer: the owner authenticates and authorizes it as if the client had reached it
//! directly. A forwarded request is never forwarded again.
//! Archiving a workspace first closes its agents on the replicas that run them. A new
//! agent is created on the replica it is pinned to (label `agentry.replica`), else on the
//! replica running the fewest agents when that runs fewer than the one asked.

use std::sync::OnceLock;
use std::time::Duration;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::http::{Method, StatusCode};
use actix_web::middleware::Next;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, ResponseError, get, web};
use futures::StreamExt;
use utoipa_actix_web::service_config::ServiceConfig;

use super::error::{ApiError, ApiResult, Problem};
use crate::api::AppState;
use crate::auth::Principal;
use crate::domain::{AgentId, WorkspaceId};
use crate::services::cluster::{self, ReplicaList};

/// Set on a request one replica hands to another.
pub const FORWARDED_BY: HeaderName = HeaderName::from_static("agentry-forwarded-by");

/// The request headers a forwarded command keeps (and the session cookie, see
/// `credentials`).
const KEPT: [&str; 8] = [
    "authorization",
    "content-type",
    "idempotency-key",
    "x-request-id",
    "accept",
    "traceparent",
    "origin",
    "referer",
];

/// The caller's credentials for another replica: the bearer token as sent, and the
/// browser session cookie alone (never the request's other cookies).
fn credentials(http: &HttpRequest, mut out: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    if let Some(session) = super::sessions::session_cookie(http) {
        out = out.header(
            "cookie",
            format!("{}={session}", crate::auth::oidc::browser::SESSION_COOKIE),
        );
    }
    out
}

pub fn configure(cfg: &mut ServiceConfig) {
    cfg.service(list);
}

/// The replicas of this deployment, each with the agents it runs (server admins).
#[utoipa::path(tag = "cluster", security(("bearer" = [])),
    responses((status = 200, body = ReplicaList), (status = 403, body = Problem)))]
#[get("/cluster")]
async fn list(
    state: web::Data<AppState>,
    principal: Principal,
) -> ApiResult<web::Json<ReplicaList>> {
    Ok(web::Json(
        cluster::list(&state.services.data, &principal).await?,
    ))
}

/// The agent a request commands, when it is one of the commands the agent's replica runs.
fn commanded_agent(method: &Method, path: &str) -> Option<AgentId> {
    let rest = path.strip_prefix("/v1/agents/")?;
    let mut parts = rest.split('/');
    let id = parts.next()?;
    let tail: Vec<&str> = parts.collect();
    let commands = match tail.as_slice() {
        [] => *method == Method::DELETE,
        ["messages" | "interrupt" | "close"] => *method == Method::POST,
        ["mode" | "model"] => *method == Method::PUT,
        ["wait"] => *method == Method::GET,
        ["permissions", _] => *method == Method::POST,
        ["messages", _] => *method == Method::DELETE,
        _ => false,
    };
    if !commands {
        return None;
    }
    id.parse().ok()
}

/// The workspace a request archives.
fn archived_workspace(method: &Method, path: &str) -> Option<WorkspaceId> {
    let id = path
        .strip_prefix("/v1/workspaces/")?
        .strip_suffix("/archive")?;
    (*method == Method::POST).then(|| id.parse().ok()).flatten()
}

/// Close the agents of workspace `ws` that other replicas run, as the caller, before the
/// workspace is archived here. Failures only log: the archive goes on, and an agent whose
/// workspace is gone ends at its replica's next lease renewal.
async fn close_elsewhere(state: &AppState, http: &HttpRequest, ws: WorkspaceId) {
    let agents =
        match cluster::remote_agents_in_workspace(&state.services.data, &state.services.fleet, ws)
            .await
        {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the workspace's agents on other replicas");
                return;
            }
        };
    for (agent, owner) in agents {
        let url = format!("{owner}/v1/agents/{agent}/close");
        let mut out = client()
            .post(&url)
            .timeout(Duration::from_secs(30))
            .header(FORWARDED_BY.as_str(), state.services.fleet.agents.replica())
            .header("content-type", "application/json")
            .body("{}");
        for name in [
            "authorization",
            "x-request-id",
            "traceparent",
            "origin",
            "referer",
        ] {
            if let Some(v) = http.headers().get(name) {
                out = out.header(name, v.as_bytes());
            }
        }
        out = credentials(http, out);
        match out.send().await {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => {
                tracing::warn!(agent_id = %agent, owner, status = r.status().as_u16(), "the agent's replica refused to close it before the archive")
            }
            Err(e) => {
                tracing::warn!(agent_id = %agent, owner, error = %e, "could not reach the agent's replica to close it before the archive")
            }
        }
    }
}

pub(super) fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(5))
            .build()
            .expect("an HTTP client")
    })
}

/// Middleware: hand commands for agents another replica runs to that replica.
pub async fn forward(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let Some(state) = req.app_data::<web::Data<AppState>>().cloned() else {
        return Ok(next.call(req).await?.map_into_boxed_body());
    };
    let local = req.headers().contains_key(FORWARDED_BY) || !state.services.data.bus.announcing();
    if !local && let Some(ws) = archived_workspace(req.method(), req.path()) {
        close_elsewhere(&state, req.request(), ws).await;
    }
    if !local && req.method() == Method::POST && req.path() == "/v1/agents" {
        return place(state, req, next).await;
    }
    let agent = if local {
        None
    } else {
        commanded_agent(req.method(), req.path())
    };
    let Some(agent) = agent else {
        return Ok(next.call(req).await?.map_into_boxed_body());
    };
    let owner = match cluster::route(&state.services.data, &state.services.fleet, agent).await {
        Ok(owner) => owner,
        Err(e) => {
            let (http, _) = req.into_parts();
            let res = ApiError::from(e).error_response();
            return Ok(ServiceResponse::new(http, res));
        }
    };
    let Some(owner) = owner else {
        return Ok(next.call(req).await?.map_into_boxed_body());
    };
    let (http, payload) = req.into_parts();
    let res = match send_on(&state, &http, payload, &owner).await {
        Ok(res) => res,
        Err(e) => e.error_response(),
    };
    Ok(ServiceResponse::new(http, res))
}

/// `POST /v1/agents`: create the agent here, or on the replica it is pinned to, or on the
/// replica running the fewest agents when that runs fewer than this one.
async fn place(
    state: web::Data<AppState>,
    mut req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let body = match read_body(&state, req.take_payload()).await {
        Ok(b) => b,
        Err(e) => {
            let (http, _) = req.into_parts();
            return Ok(ServiceResponse::new(http, e.error_response()));
        }
    };
    // An unreadable body is the create handler's to refuse.
    let labels = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("labels").cloned());
    let target =
        match cluster::place(&state.services.data, &state.services.fleet, labels.as_ref()).await {
            Ok(t) => t,
            Err(e) => {
                let (http, _) = req.into_parts();
                return Ok(ServiceResponse::new(
                    http,
                    ApiError::from(e).error_response(),
                ));
            }
        };
    match target {
        None => {
            req.set_payload(super::input::replay(body));
            Ok(next.call(req).await?.map_into_boxed_body())
        }
        Some(url) => {
            let (http, _) = req.into_parts();
            let res = match send_body(&state, &http, body, &url).await {
                Ok(res) => res,
                Err(e) => e.error_response(),
            };
            Ok(ServiceResponse::new(http, res))
        }
    }
}

/// The request body, within the size limit.
async fn read_body(
    state: &AppState,
    mut payload: actix_web::dev::Payload,
) -> Result<web::Bytes, ApiError> {
    let limit = state.settings.limits.max_body_bytes;
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request("invalid_body", e.to_string()))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!("the body is larger than {limit} bytes"),
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// Send the request on to `owner` and turn its answer into this one.
async fn send_on(
    state: &AppState,
    http: &HttpRequest,
    payload: actix_web::dev::Payload,
    owner: &str,
) -> Result<HttpResponse, ApiError> {
    let body = read_body(state, payload).await?;
    send_body(state, http, body, owner).await
}

async fn send_body(
    state: &AppState,
    http: &HttpRequest,
    body: web::Bytes,
    owner: &str,
) -> Result<HttpResponse, ApiError> {
    let url = format!(
        "{owner}{}",
        http.uri().path_and_query().map_or("", |p| p.as_str())
    );
    let method = reqwest::Method::from_bytes(http.method().as_str().as_bytes())
        .map_err(ApiError::internal)?;
    let mut out = client()
        .request(method, &url)
        .timeout(Duration::from_secs(state.settings.limits.max_wait_s + 30))
        .header(FORWARDED_BY.as_str(), state.services.fleet.agents.replica())
        .body(body);
    for name in KEPT {
        if let Some(v) = http.headers().get(name) {
            out = out.header(name, v.as_bytes());
        }
    }
    out = credentials(http, out);
    let unreachable = |e: reqwest::Error| {
        tracing::warn!(owner, error = %e, "could not hand a command to the agent's replica");
        ApiError::unavailable(
            "replica_unreachable",
            "the replica running this agent did not answer; retry (if it stopped, another \
             replica takes the agent over within the lease time)",
        )
    };
    let res = out.send().await.map_err(unreachable)?;
    let status = StatusCode::from_u16(res.status().as_u16()).map_err(ApiError::internal)?;
    let mut answer = HttpResponse::build(status);
    for (name, value) in res.headers() {
        let keep = matches!(
            name.as_str(),
            "content-type" | "retry-after" | "location" | "idempotency-replayed"
        );
        if keep && let Ok(v) = HeaderValue::from_bytes(value.as_bytes()) {
            answer.insert_header((name.as_str(), v));
        }
    }
    let bytes = res.bytes().await.map_err(unreachable)?;
    Ok(answer.body(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_agent_commands_are_handed_over() {
        let id = "agt_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b";
        let cases = [
            (Method::POST, format!("/v1/agents/{id}/messages"), true),
            (Method::POST, format!("/v1/agents/{id}/interrupt"), true),
            (Method::POST, format!("/v1/agents/{id}/close"), true),
            (Method::PUT, format!("/v1/agents/{id}/mode"), true),
            (Method::PUT, format!("/v1/agents/{id}/model"), true),
            (Method::GET, format!("/v1/agents/{id}/wait"), true),
            (Method::DELETE, format!("/v1/agents/{id}"), true),
            (
                Method::POST,
                format!("/v1/agents/{id}/permissions/prq_1"),
                true,
            ),
            (Method::GET, format!("/v1/agents/{id}"), false),
            (Method::GET, format!("/v1/agents/{id}/events"), false),
            (Method::GET, format!("/v1/agents/{id}/timeline"), false),
            (Method::GET, format!("/v1/agents/{id}/permissions"), false),
            (Method::POST, "/v1/agents".to_owned(), false),
            (Method::POST, "/v1/agents/nope/messages".to_owned(), false),
        ];
        let ws = "wsp_0193a1b2c3d47e8f9a0b1c2d3e4f5a6c";
        assert!(
            archived_workspace(&Method::POST, &format!("/v1/workspaces/{ws}/archive")).is_some()
        );
        assert!(
            archived_workspace(&Method::GET, &format!("/v1/workspaces/{ws}/archive")).is_none()
        );
        assert!(archived_workspace(&Method::POST, &format!("/v1/workspaces/{ws}")).is_none());
        for (method, path, handed) in cases {
            assert_eq!(
                commanded_agent(&method, &path).is_some(),
                handed,
                "{method} {path}"
            );
        }
    }
}
