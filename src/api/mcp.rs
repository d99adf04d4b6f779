//! `/mcp`: the same API as a Model Context Protocol server, over the streamable HTTP
//! transport (revisions 2025-11-25, 2025-06-18 and 2025-03-26). Each POST carries one
//! JSON-RPC message and a request is answered with one `application/json` body (the
//! transport's optional SSE response streams are not offered); `GET` answers 405, since
//! the server sends nothing of its own accord; `DELETE` ends the session that
//! `initialize` opened (`Mcp-Session-Id`).
//!
//! Each tool is one `/v1` operation: its input schema is that operation's path and query
//! parameters and request body, taken from the OpenAPI document; its arguments are parsed
//! into the route's own request types; its token scope is the route's (`access::ROUTES`);
//! and it calls what the route's handler calls. A failure is a tool result with
//! `isError: true` whose structured content is the problem the route would answer (with
//! its `code`). Only a bearer token authenticates here: a browser session is not enough.
//!
//! Sessions live in the memory of the replica that opened them (bound to the token that
//! opened them); a client that reaches another replica is told 404 and initializes again.
//! A command for an agent another replica runs is handed to that replica as its `/v1`
//! request, with the caller's token, as `api::cluster` hands over REST commands.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use actix_web::http::{StatusCode, header};
use actix_web::{HttpRequest, HttpResponse, web};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::agents::{TimelineQuery, WaitQuery, timeline_page};
use super::error::{ApiError, ApiResult};
use super::providers::ProvidersQuery;
use super::workspaces::{WorkspaceFilter, list_page};
use super::{PageQuery, parse_id};
use crate::api::AppState;
use crate::auth::{AuthError, Operation, Principal};
use crate::domain::{AgentId, PermissionId, TeamId, WorkspaceId};
use crate::services::agents::{self, CreateAgent, PermissionAnswerBody, PromptBody, TimelineFrom};
use crate::services::streams::Guard;
use crate::services::{ServiceContext, providers, workspaces};

/// The revisions spoken, newest first; a client asking for another one is offered the
/// first.
pub const PROTOCOL_VERSIONS: &[&str] = &["2025-11-25", "2025-06-18", "2025-03-26"];

const SESSION_HEADER: &str = "mcp-session-id";
const VERSION_HEADER: &str = "mcp-protocol-version";
/// Sessions kept per replica; past it the longest idle one is forgotten.
const MAX_SESSIONS: usize = 10_000;
/// A session unused this long is forgotten.
const SESSION_IDLE: Duration = Duration::from_secs(24 * 3600);
/// `wait_for_agent` without `timeout_s`: short enough for a client's request timeout.
const DEFAULT_WAIT_S: u64 = 60;

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::resource("/mcp")
            .route(web::post().to(post))
            .route(web::delete().to(delete))
            .route(web::get().to(no_stream)),
    );
}

/// The open sessions of this replica.
#[derive(Default)]
pub struct Sessions {
    open: Mutex<HashMap<String, Session>>,
}

struct Session {
    user_id: Uuid,
    token_id: Uuid,
    last_used: Instant,
}

impl Session {
    fn belongs_to(&self, p: &Principal) -> bool {
        self.user_id == p.user_id && self.token_id == p.token_id
    }
}

impl Sessions {
    fn open(&self, p: &Principal) -> String {
        let id = Uuid::new_v4().simple().to_string();
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        open.retain(|_, s| now.duration_since(s.last_used) < SESSION_IDLE);
        if open.len() >= MAX_SESSIONS
            && let Some(oldest) = open
                .iter()
                .min_by_key(|(_, s)| s.last_used)
                .map(|(k, _)| k.clone())
        {
            open.remove(&oldest);
        }
        open.insert(
            id.clone(),
            Session {
                user_id: p.user_id,
                token_id: p.token_id,
                last_used: now,
            },
        );
        id
    }

    /// Whether `id` is a live session of this caller (and mark it used).
    fn touch(&self, id: &str, p: &Principal) -> bool {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        match open.get_mut(id) {
            Some(s) if s.belongs_to(p) => {
                s.last_used = Instant::now();
                true
            }
            _ => false,
        }
    }

    fn close(&self, id: &str, p: &Principal) -> bool {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        match open.get(id) {
            Some(s) if s.belongs_to(p) => {
                open.remove(id);
                true
            }
            _ => false,
        }
    }
}

/// The caller, from its bearer token only (a session cookie does not count here).
async fn authenticate(req: &HttpRequest) -> ApiResult<Principal> {
    if req.headers().get(header::AUTHORIZATION).is_none() {
        return Err(AuthError::TokenMissing.into());
    }
    let principal = super::auth::authenticate_request(req).await?;
    principal.authorize(Operation::ReadSelf)?;
    Ok(principal)
}

async fn no_stream() -> HttpResponse {
    HttpResponse::MethodNotAllowed()
        .insert_header((header::ALLOW, "POST, DELETE"))
        .finish()
}

async fn delete(state: web::Data<AppState>, req: HttpRequest) -> ApiResult<HttpResponse> {
    let principal = authenticate(&req).await?;
    let id = session_id(&req).ok_or_else(|| {
        ApiError::bad_request("mcp_session_missing", "send the Mcp-Session-Id header")
    })?;
    if state.mcp.close(id, &principal) {
        Ok(HttpResponse::NoContent().finish())
    } else {
        Err(ApiError::not_found("MCP session"))
    }
}

fn session_id(req: &HttpRequest) -> Option<&str> {
    req.headers()
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
}

// JSON-RPC error codes.
const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;

fn rpc_error(status: StatusCode, id: Value, code: i64, message: &str) -> HttpResponse {
    HttpResponse::build(status).json(json!({
        "jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}
    }))
}

async fn post(
    state: web::Data<AppState>,
    req: HttpRequest,
    body: web::Bytes,
) -> ApiResult<HttpResponse> {
    let principal = authenticate(&req).await?;
    let Ok(message) = serde_json::from_slice::<Value>(&body) else {
        return Ok(rpc_error(
            StatusCode::BAD_REQUEST,
            Value::Null,
            PARSE_ERROR,
            "the body is not JSON",
        ));
    };
    let Some(message) = message.as_object() else {
        return Ok(rpc_error(
            StatusCode::BAD_REQUEST,
            Value::Null,
            INVALID_REQUEST,
            "send one JSON-RPC message per request (batches are not part of this revision)",
        ));
    };
    let id = message.get("id").cloned();
    let method = message.get("method").and_then(Value::as_str);
    let (Some(method), Some(id)) = (method, id) else {
        // A notification, or a response to a request: the server sends none, and the
        // notifications it may get (`initialized`, `cancelled`) need no action.
        return Ok(HttpResponse::Accepted().finish());
    };
    let params = message.get("params").cloned().unwrap_or(Value::Null);
    if method == "initialize" {
        return Ok(initialize(&state, &principal, id, &params));
    }
    if !matches!(method, "ping" | "tools/list" | "tools/call") {
        // Also the answer to a probe for a later revision (`server/discover`), before any
        // session: the client then falls back to `initialize`.
        return Ok(rpc_error(
            StatusCode::OK,
            id,
            METHOD_NOT_FOUND,
            &format!("method `{method}` is not offered"),
        ));
    }
    if let Some(v) = req.headers().get(VERSION_HEADER)
        && !PROTOCOL_VERSIONS
            .iter()
            .any(|p| v.as_bytes() == p.as_bytes())
    {
        return Ok(rpc_error(
            StatusCode::BAD_REQUEST,
            id,
            INVALID_REQUEST,
            "unsupported MCP-Protocol-Version",
        ));
    }
    match session_id(&req) {
        None => {
            return Ok(rpc_error(
                StatusCode::BAD_REQUEST,
                id,
                INVALID_REQUEST,
                "send the Mcp-Session-Id that initialize answered",
            ));
        }
        Some(s) if !state.mcp.touch(s, &principal) => {
            return Ok(rpc_error(
                StatusCode::NOT_FOUND,
                id,
                INVALID_REQUEST,
                "unknown or ended session; initialize again",
            ));
        }
        Some(_) => {}
    }
    let result = match method {
        "tools/list" => json!({"tools": tools()}),
        "tools/call" => {
            let Some(name) = params.get("name").and_then(Value::as_str) else {
                return Ok(rpc_error(
                    StatusCode::OK,
                    id,
                    INVALID_PARAMS,
                    "tools/call needs a tool `name`",
                ));
            };
            if !TOOLS.iter().any(|t| t.name == name) {
                return Ok(rpc_error(
                    StatusCode::OK,
                    id,
                    INVALID_PARAMS,
                    &format!("unknown tool `{name}`"),
                ));
            }
            let arguments = match params.get("arguments") {
                None | Some(Value::Null) => Map::new(),
                Some(Value::Object(m)) => m.clone(),
                Some(_) => {
                    return Ok(rpc_error(
                        StatusCode::OK,
                        id,
                        INVALID_PARAMS,
                        "`arguments` must be an object",
                    ));
                }
            };
            match call(&state.services, &principal, &req, name, arguments).await {
                Ok(out) => json!({
                    "content": [{"type": "text", "text": out.text}],
                    "structuredContent": out.structured,
                    "isError": false,
                }),
                Err(e) => {
                    let problem = match e {
                        ToolError::Local(e) => {
                            serde_json::to_value(e.problem()).unwrap_or_default()
                        }
                        ToolError::Remote(problem) => problem,
                    };
                    let text = format!(
                        "{}: {}",
                        problem["code"].as_str().unwrap_or("error"),
                        problem["detail"].as_str().unwrap_or("")
                    );
                    json!({
                        "content": [{"type": "text", "text": text}],
                        "structuredContent": problem,
                        "isError": true,
                    })
                }
            }
        }
        _ => json!({}),
    };
    Ok(HttpResponse::Ok().json(json!({"jsonrpc": "2.0", "id": id, "result": result})))
}

fn initialize(state: &AppState, principal: &Principal, id: Value, params: &Value) -> HttpResponse {
    let asked = params.get("protocolVersion").and_then(Value::as_str);
    let version = PROTOCOL_VERSIONS
        .iter()
        .find(|v| Some(**v) == asked)
        .unwrap_or(&PROTOCOL_VERSIONS[0]);
    let session = state.mcp.open(principal);
    HttpResponse::Ok()
        .insert_header((SESSION_HEADER, session))
        .json(json!({"jsonrpc": "2.0", "id": id, "result": {
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": false}},
            "serverInfo": {"name": "agentry", "version": env!("CARGO_PKG_VERSION")},
            "instructions": "agentry runs coding agents in git worktrees. Open one with \
                create_agent (a prompt starts its first turn), follow it with wait_for_agent \
                and get_timeline, answer what it asks with answer_permission, read its \
                changes with get_diff, and archive_agent when done.",
        }}))
}

/// One tool: the `/v1` operation it is, and which tool argument fills which path
/// parameter.
pub struct ToolSpec {
    pub name: &'static str,
    pub method: &'static str,
    pub path: &'static str,
    /// (path parameter, tool argument)
    pub path_args: &'static [(&'static str, &'static str)],
    pub description: &'static str,
}

pub const TOOLS: &[ToolSpec] = &[
    ToolSpec {
        name: "list_providers",
        method: "GET",
        path: "/v1/providers",
        path_args: &[],
        description: "The agent CLIs this server runs (ids for create_agent), whether each is \
            available to the team and why not, their modes.",
    },
    ToolSpec {
        name: "list_workspaces",
        method: "GET",
        path: "/v1/workspaces",
        path_args: &[],
        description: "The team's workspaces (git worktrees agents work in), newest first, a \
            page at a time (`cursor` from `next_cursor`).",
    },
    ToolSpec {
        name: "create_workspace",
        method: "POST",
        path: "/v1/workspaces",
        path_args: &[],
        description: "Create a workspace of a project: a new git worktree on a new branch \
            (default) or the project's own directory.",
    },
    ToolSpec {
        name: "create_agent",
        method: "POST",
        path: "/v1/agents",
        path_args: &[],
        description: "Open an agent in an existing workspace (`workspace_id`) or a new \
            worktree (`workspace: {project_id}`); a `prompt` starts its first turn at once.",
    },
    ToolSpec {
        name: "send_message",
        method: "POST",
        path: "/v1/agents/{id}/messages",
        path_args: &[("id", "agent_id")],
        description: "Send a prompt to an agent (a closed one is reopened first); answers the \
            new turn's id. While the agent's turn runs the message is queued (queued: true, \
            message_id) and runs after it; queue: false answers agent_busy instead; \
            interrupt: true stops the running turn and sends this message next.",
    },
    ToolSpec {
        name: "wait_for_agent",
        method: "GET",
        path: "/v1/agents/{id}/wait",
        path_args: &[("id", "agent_id")],
        description: "Wait until the agent is neither running nor starting (at most \
            `timeout_s`, 60 by default here): its status, the last turn's outcome, the \
            pending permission requests and the last assistant message.",
    },
    ToolSpec {
        name: "get_timeline",
        method: "GET",
        path: "/v1/agents/{id}/timeline",
        path_args: &[("id", "agent_id")],
        description: "A page of the agent's events (oldest first after `after_seq`, newest \
            first before `before_seq`), rendered as compact text lines; the events \
            themselves are in the structured result.",
    },
    ToolSpec {
        name: "get_diff",
        method: "GET",
        path: "/v1/workspaces/{id}/diff",
        path_args: &[("id", "workspace_id")],
        description: "The workspace's changes (including untracked files) against its base \
            commit: changed files and the patch.",
    },
    ToolSpec {
        name: "answer_permission",
        method: "POST",
        path: "/v1/agents/{id}/permissions/{request_id}",
        path_args: &[("id", "agent_id"), ("request_id", "request_id")],
        description: "Answer an agent's permission request (`request_id` from \
            wait_for_agent's pending_permissions) with allow or deny.",
    },
    ToolSpec {
        name: "interrupt_agent",
        method: "POST",
        path: "/v1/agents/{id}/interrupt",
        path_args: &[("id", "agent_id")],
        description: "Interrupt the agent's running turn; it ends canceled.",
    },
    ToolSpec {
        name: "archive_agent",
        method: "DELETE",
        path: "/v1/agents/{id}",
        path_args: &[("id", "agent_id")],
        description: "Archive the agent: stop it and hide it from lists; its timeline is kept.",
    },
];

/// The tool list, its schemas taken from the OpenAPI document once.
pub fn tools() -> &'static [Value] {
    static LIST: OnceLock<Vec<Value>> = OnceLock::new();
    LIST.get_or_init(|| {
        let doc = serde_json::to_value(super::docs::document()).expect("the document serialises");
        TOOLS
            .iter()
            .map(|t| {
                json!({
                    "name": t.name,
                    "description": t.description,
                    "inputSchema": input_schema(&doc, t),
                    "annotations": {
                        "readOnlyHint": t.method == "GET",
                        "destructiveHint": t.method == "DELETE",
                        "openWorldHint": false,
                    },
                })
            })
            .collect()
    })
}

/// The tool's arguments as one object schema: the operation's path parameters (under
/// the tool's names for them), its query parameters and its request body's properties.
pub fn input_schema(doc: &Value, tool: &ToolSpec) -> Value {
    let op = &doc["paths"][tool.path][tool.method.to_lowercase()];
    let mut properties = Map::new();
    let mut required = Vec::new();
    for p in op["parameters"].as_array().into_iter().flatten() {
        let name = p["name"].as_str().unwrap_or_default();
        let mut schema = inline(doc, &p["schema"], 0);
        if let Some(d) = p.get("description") {
            schema["description"] = d.clone();
        }
        match p["in"].as_str() {
            Some("path") => {
                let arg = tool
                    .path_args
                    .iter()
                    .find(|(param, _)| *param == name)
                    .map_or(name, |(_, arg)| *arg);
                properties.insert(arg.to_owned(), schema);
                required.push(Value::from(arg));
            }
            Some("query") => {
                properties.insert(name.to_owned(), schema);
            }
            _ => {}
        }
    }
    let body = &op["requestBody"]["content"]["application/json"]["schema"];
    if !body.is_null() {
        let body = inline(doc, body, 0);
        if let Some(props) = body["properties"].as_object() {
            properties.extend(props.clone());
        }
        if let Some(req) = body["required"].as_array() {
            required.extend(req.iter().cloned());
        }
    }
    json!({
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    })
}

/// `schema` with every `$ref` to a component replaced by the component itself (a tool's
/// schema must stand alone).
pub fn inline(doc: &Value, schema: &Value, depth: usize) -> Value {
    if depth > 16 {
        return json!({});
    }
    match schema {
        Value::Object(map) => {
            if let Some(target) = map.get("$ref").and_then(Value::as_str) {
                let name = target.trim_start_matches("#/components/schemas/");
                let mut resolved = inline(doc, &doc["components"]["schemas"][name], depth + 1);
                if let Some(obj) = resolved.as_object_mut() {
                    for (k, v) in map.iter().filter(|(k, _)| *k != "$ref") {
                        obj.insert(k.clone(), inline(doc, v, depth + 1));
                    }
                }
                return resolved;
            }
            Value::Object(
                map.iter()
                    .filter(|(k, _)| *k != "example" && *k != "examples")
                    .map(|(k, v)| (k.clone(), inline(doc, v, depth + 1)))
                    .collect(),
            )
        }
        Value::Array(items) => {
            Value::Array(items.iter().map(|v| inline(doc, v, depth + 1)).collect())
        }
        other => other.clone(),
    }
}

/// What a tool answers: text for a model, and the API's object.
struct ToolOutput {
    text: String,
    structured: Value,
}

impl ToolOutput {
    fn json(value: impl serde::Serialize) -> ApiResult<Self> {
        let structured = serde_json::to_value(value).map_err(ApiError::internal)?;
        Ok(Self {
            text: structured.to_string(),
            structured,
        })
    }
}

/// A tool's arguments, taken apart into the route's path parameters, query and body.
struct Args(Map<String, Value>);

impl Args {
    fn id<T: std::str::FromStr>(&mut self, arg: &str, what: &str) -> ApiResult<T> {
        match self.0.remove(arg) {
            Some(Value::String(s)) => parse_id(&s, what),
            Some(_) => Err(ApiError::validation(arg, "must be a string")),
            None => Err(ApiError::validation(arg, "is required")),
        }
    }

    fn query<Q: DeserializeOwned>(&mut self, names: &[&str]) -> ApiResult<Q> {
        let picked: Map<String, Value> = names
            .iter()
            .filter_map(|n| self.0.remove(*n).map(|v| ((*n).to_owned(), v)))
            .filter(|(_, v)| !v.is_null())
            .collect();
        serde_json::from_value(Value::Object(picked))
            .map_err(|e| ApiError::validation("arguments", e.to_string()))
    }

    fn body<B: DeserializeOwned>(self) -> ApiResult<B> {
        serde_json::from_value(Value::Object(self.0))
            .map_err(|e| ApiError::validation("arguments", e.to_string()))
    }

    fn done(self) -> ApiResult<()> {
        match self.0.keys().next() {
            None => Ok(()),
            Some(k) => Err(ApiError::validation(k, "unknown argument")),
        }
    }
}

/// Why a tool failed: a problem of this replica, or the one the agent's replica answered.
enum ToolError {
    Local(ApiError),
    Remote(Value),
}

impl<E: Into<ApiError>> From<E> for ToolError {
    fn from(e: E) -> Self {
        ToolError::Local(e.into())
    }
}

type ToolResult<T> = Result<T, ToolError>;

/// The replica running `agent`, when that is another one.
async fn owner_elsewhere(ctx: &ServiceContext, agent: AgentId) -> ApiResult<Option<String>> {
    if !ctx.data.bus.announcing() {
        return Ok(None);
    }
    Ok(crate::services::cluster::route(&ctx.data, &ctx.fleet, agent).await?)
}

/// Hand a command for an agent another replica runs to that replica as its route's own
/// request (`path` filled in), with the caller's bearer token, as `/v1` does
/// (`api::cluster`); its JSON answer (null for none), or its problem.
async fn forward(
    ctx: &ServiceContext,
    req: &HttpRequest,
    owner: &str,
    tool: &ToolSpec,
    path: &str,
    body: Option<Value>,
) -> ToolResult<Value> {
    let method = reqwest::Method::from_bytes(tool.method.as_bytes()).map_err(ApiError::internal)?;
    let mut out = super::cluster::client()
        .request(method, format!("{owner}{path}"))
        .timeout(Duration::from_secs(ctx.fleet.limits.max_wait_s + 30))
        .header(
            super::cluster::FORWARDED_BY.as_str(),
            ctx.fleet.agents.replica(),
        );
    for name in ["authorization", "x-request-id", "traceparent"] {
        if let Some(v) = req.headers().get(name) {
            out = out.header(name, v.as_bytes());
        }
    }
    if let Some(body) = body {
        out = out.json(&body);
    }
    let unreachable = |e: reqwest::Error| {
        tracing::warn!(owner, error = %e, "could not hand a tool call to the agent's replica");
        ApiError::unavailable(
            "replica_unreachable",
            "the replica running this agent did not answer; retry (if it stopped, another \
             replica takes the agent over within the lease time)",
        )
    };
    let res = out.send().await.map_err(unreachable)?;
    let ok = res.status().is_success();
    let bytes = res.bytes().await.map_err(unreachable)?;
    let answer: Value = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).map_err(ApiError::internal)?
    };
    if ok {
        Ok(answer)
    } else {
        Err(ToolError::Remote(answer))
    }
}

/// `path` with its `{id}` (and `{request_id}`) filled in.
fn fill(path: &str, id: &str, request: Option<&str>) -> String {
    let path = path.replace("{id}", id);
    match request {
        Some(r) => path.replace("{request_id}", r),
        None => path,
    }
}

/// Run tool `name` as `principal`, with the scope check of its route first.
async fn call(
    ctx: &ServiceContext,
    principal: &Principal,
    req: &HttpRequest,
    name: &str,
    arguments: Map<String, Value>,
) -> ToolResult<ToolOutput> {
    let tool = TOOLS
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| ApiError::not_found("tool"))?;
    let op = super::access::operation(tool.method, tool.path)
        .ok_or_else(|| ApiError::internal(anyhow::anyhow!("tool {name} has no route policy")))?;
    principal.authorize(op)?;
    if let Some(field) =
        super::input::field_with_nul(&Value::Object(arguments.clone()), String::new())
    {
        return Err(ApiError::validation(&field, "contains U+0000").into());
    }
    let mut args = Args(arguments);
    match name {
        "list_providers" => {
            let q: ProvidersQuery = args.query(&["team_id"])?;
            args.done()?;
            let team = q
                .team_id
                .as_deref()
                .map(|t| parse_id::<TeamId>(t, "team"))
                .transpose()?;
            Ok(ToolOutput::json(
                providers::list(ctx, principal, team).await?,
            )?)
        }
        "list_workspaces" => {
            let filter: WorkspaceFilter = args.query(&["project_id", "include_archived"])?;
            let page: PageQuery = args.query(&["limit", "cursor"])?;
            args.done()?;
            Ok(ToolOutput::json(
                list_page(ctx, principal, &filter, &page).await?,
            )?)
        }
        "create_workspace" => {
            let body: workspaces::CreateWorkspace = args.body()?;
            Ok(ToolOutput::json(
                workspaces::create(ctx, principal, &body).await?,
            )?)
        }
        "create_agent" => {
            let body: CreateAgent = args.body()?;
            Ok(ToolOutput::json(
                agents::create(ctx, principal, &body).await?,
            )?)
        }
        "send_message" => {
            let id: AgentId = args.id("agent_id", "agent")?;
            let body: PromptBody = args.body()?;
            if let Some(owner) = owner_elsewhere(ctx, id).await? {
                let path = fill(tool.path, &id.to_string(), None);
                let body = serde_json::to_value(&body).map_err(ApiError::internal)?;
                return Ok(ToolOutput::json(
                    forward(ctx, req, &owner, tool, &path, Some(body)).await?,
                )?);
            }
            Ok(ToolOutput::json(
                agents::prompt(ctx, principal, id, body).await?,
            )?)
        }
        "wait_for_agent" => {
            let id: AgentId = args.id("agent_id", "agent")?;
            let q: WaitQuery = args.query(&["timeout_s"])?;
            args.done()?;
            wait_for_agent(ctx, principal, req, tool, id, q).await
        }
        "get_timeline" => {
            let id: AgentId = args.id("agent_id", "agent")?;
            let q: TimelineQuery = args.query(&["after_seq", "before_seq", "limit", "cursor"])?;
            args.done()?;
            let page = timeline_page(ctx, principal, id, &q).await?;
            let structured = serde_json::to_value(&page).map_err(ApiError::internal)?;
            Ok(ToolOutput {
                text: render_timeline(&structured),
                structured,
            })
        }
        "get_diff" => {
            let id: WorkspaceId = args.id("workspace_id", "workspace")?;
            args.done()?;
            Ok(ToolOutput::json(
                workspaces::diff(&ctx.data, principal, id).await?,
            )?)
        }
        "answer_permission" => {
            let id: AgentId = args.id("agent_id", "agent")?;
            let request: PermissionId = args.id("request_id", "permission request")?;
            let raw = Value::Object(args.0.clone());
            let body: PermissionAnswerBody = args.body()?;
            if let Some(owner) = owner_elsewhere(ctx, id).await? {
                let path = fill(tool.path, &id.to_string(), Some(&request.to_string()));
                return Ok(ToolOutput::json(
                    forward(ctx, req, &owner, tool, &path, Some(raw)).await?,
                )?);
            }
            Ok(ToolOutput::json(
                agents::answer_permission(ctx, principal, id, request, body).await?,
            )?)
        }
        "interrupt_agent" => {
            let id: AgentId = args.id("agent_id", "agent")?;
            args.done()?;
            match owner_elsewhere(ctx, id).await? {
                Some(owner) => {
                    let path = fill(tool.path, &id.to_string(), None);
                    forward(ctx, req, &owner, tool, &path, None).await?;
                }
                None => agents::interrupt(ctx, principal, id).await?,
            }
            Ok(ToolOutput::json(
                json!({"agent_id": id, "interrupted": true}),
            )?)
        }
        "archive_agent" => {
            let id: AgentId = args.id("agent_id", "agent")?;
            args.done()?;
            match owner_elsewhere(ctx, id).await? {
                Some(owner) => {
                    let path = fill(tool.path, &id.to_string(), None);
                    forward(ctx, req, &owner, tool, &path, None).await?;
                }
                None => agents::archive(ctx, principal, id, false).await?,
            }
            Ok(ToolOutput::json(json!({"agent_id": id, "archived": true}))?)
        }
        _ => Err(ApiError::not_found("tool").into()),
    }
}

/// The wait of `GET /v1/agents/{id}/wait` (ended early when the caller loses access; on
/// the agent's replica when another one runs it), plus the agent's last assistant message.
async fn wait_for_agent(
    ctx: &ServiceContext,
    principal: &Principal,
    req: &HttpRequest,
    tool: &ToolSpec,
    id: AgentId,
    q: WaitQuery,
) -> ToolResult<ToolOutput> {
    let timeout_s = q.timeout_s.unwrap_or(DEFAULT_WAIT_S);
    let mut done = match owner_elsewhere(ctx, id).await? {
        Some(owner) => {
            let path = format!(
                "{}?timeout_s={timeout_s}",
                fill(tool.path, &id.to_string(), None)
            );
            forward(ctx, req, &owner, tool, &path, None).await?
        }
        None => {
            let guard = Guard::for_agent(ctx, id, super::sse::recheck(req));
            let done = tokio::select! {
                done = agents::wait(ctx, principal, id, Duration::from_secs(timeout_s)) => done?,
                ending = guard.ended() => return Err(super::sse::ending_error(ending).into()),
            };
            serde_json::to_value(&done).map_err(ApiError::internal)?
        }
    };
    let last = agents::timeline(ctx, principal, id, TimelineFrom::Before(i64::MAX), 200).await?;
    let last_message = last
        .items
        .iter()
        .find(|e| e.kind.as_str() == "assistant_message")
        .and_then(|e| e.data["text"].as_str())
        .map(str::to_owned);
    done["last_assistant_message"] = json!(last_message);
    let mut text = format!("status: {}", done["status"].as_str().unwrap_or("?"));
    if done["timed_out"] == true {
        text.push_str(" (timed out; call wait_for_agent again)");
    }
    let turn = &done["last_turn"];
    if let Some(turn_id) = turn["turn_id"].as_str() {
        text.push_str(&format!(
            "\nlast turn {turn_id}: {}",
            turn["outcome"].as_str().unwrap_or("running")
        ));
        if let Some(e) = turn["error"].as_str() {
            text.push_str(&format!(" ({e})"));
        }
    }
    for p in done["pending_permissions"].as_array().into_iter().flatten() {
        text.push_str(&format!(
            "\npending permission {}: {} (options: {})",
            p["request_id"].as_str().unwrap_or("?"),
            p["title"].as_str().unwrap_or(""),
            options_text(&p["options"])
        ));
    }
    if let Some(m) = &last_message {
        text.push_str("\nlast assistant message:\n");
        text.push_str(m);
    }
    Ok(ToolOutput {
        text,
        structured: done,
    })
}

fn options_text(options: &Value) -> String {
    options
        .as_array()
        .into_iter()
        .flatten()
        .map(|o| {
            format!(
                "{} = {}",
                o["id"].as_str().unwrap_or("?"),
                o["behavior"].as_str().unwrap_or("?")
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Longest text of one event in the compact rendering.
const RENDER_TEXT_CHARS: usize = 2000;

fn clip(s: &str) -> String {
    match s.char_indices().nth(RENDER_TEXT_CHARS) {
        Some((at, _)) => format!("{}… [{} more bytes]", &s[..at], s.len() - at),
        None => s.to_owned(),
    }
}

/// A timeline page as one line per event for a model to read: streaming chunks are left
/// out (each message is also whole in its `assistant_message`), everything else says
/// what happened in a few words.
pub fn render_timeline(page: &Value) -> String {
    let mut out = String::new();
    for e in page["items"].as_array().into_iter().flatten() {
        let d = &e["data"];
        let s = |k: &str| d[k].as_str().unwrap_or("").to_owned();
        let line = match e["kind"].as_str().unwrap_or("") {
            "assistant_delta" | "reasoning_delta" => continue,
            "user_message" => format!("user: {}", clip(&s("text"))),
            "assistant_message" => format!("assistant: {}", clip(&s("text"))),
            "reasoning" => format!("reasoning: {}", clip(&s("text"))),
            "turn_started" => format!("turn {} started", s("turn_id")),
            "turn_completed" => {
                let mut l = format!("turn {} {}", s("turn_id"), s("outcome"));
                if let Some(err) = d["error"].as_str() {
                    l.push_str(&format!(": {}", clip(err)));
                }
                l
            }
            "tool_call" => {
                let mut l = format!(
                    "tool {} [{}] {} ({})",
                    s("call_id"),
                    s("status"),
                    clip(&s("title")),
                    s("name")
                );
                if let Some(child) = d["child_agent"].as_str() {
                    l.push_str(&format!(" -> child agent {child}"));
                }
                l
            }
            "permission_requested" => format!(
                "permission {} requested: {} (options: {})",
                s("request_id"),
                clip(&s("title")),
                options_text(&d["options"])
            ),
            "permission_resolved" => {
                format!("permission {} answered {}", s("request_id"), s("behavior"))
            }
            "status" => format!("status {}", s("status")),
            "error" => format!("error: {}", clip(&s("message"))),
            kind => format!("{kind} {}", clip(&d.to_string())),
        };
        out.push_str(&format!("#{} {line}\n", e["seq"]));
    }
    match page["next_cursor"].as_str() {
        Some(c) => out.push_str(&format!("(more: cursor {c})")),
        None => out.push_str("(end of timeline in this direction)"),
    }
    out
}
