//! What the handlers' annotations cannot say one by one: the error answers every
//! operation can give, always as `application/problem+json`, and the OpenAPI links that
//! lead a client (or a stateful API fuzzer) from a created resource to what acts on it.
//!
//! The error statuses follow from the shape of each operation, by the same rules the
//! server applies to every request (see `error_statuses`), so a new handler is documented
//! correctly without repeating them.

use serde_json::{Map, Value, json};
use utoipa::openapi::OpenApi;

const PROBLEM_JSON: &str = "application/problem+json";

/// Add the shared error answers and the links to a generated document.
pub fn complete(mut doc: OpenApi) -> OpenApi {
    // Only the paths change; they go through JSON, which is how these rules read best.
    let mut paths = serde_json::to_value(&doc.paths).expect("the paths serialise");
    let map = paths.as_object_mut().expect("paths is an object");
    for (path, item) in map.iter_mut() {
        let Some(item) = item.as_object_mut() else {
            continue;
        };
        for (method, op) in item.iter_mut() {
            if let Some(op) = op.as_object_mut() {
                complete_operation(path, method, op);
            }
        }
    }
    add_links(map);
    doc.paths = serde_json::from_value(paths).expect("the completed paths are valid");
    doc
}

/// What an operation looks like from outside, which decides the errors it can answer.
struct Shape {
    authenticated: bool,
    reads_only: bool,
    has_body: bool,
    has_path_params: bool,
    has_inputs: bool,
    names_ids: bool,
    idempotent: bool,
}

impl Shape {
    fn of(path: &str, method: &str, op: &Map<String, Value>) -> Self {
        let params: Vec<(&str, &str)> = op
            .get("parameters")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|p| Some((p.get("name")?.as_str()?, p.get("in")?.as_str()?)))
            .collect();
        let has_body = op.contains_key("requestBody");
        Shape {
            authenticated: path.starts_with("/v1/"),
            reads_only: method == "get",
            has_body,
            has_path_params: params.iter().any(|(_, at)| *at == "path"),
            has_inputs: has_body || !params.is_empty(),
            names_ids: params
                .iter()
                .any(|(name, at)| *at == "query" && name.ends_with("_id")),
            idempotent: params
                .iter()
                .any(|(name, at)| *at == "header" && name.eq_ignore_ascii_case("idempotency-key")),
        }
    }
}

/// The error statuses an operation can answer, besides those its handler documents:
/// - 400: a query, header or body that does not parse;
/// - 401: a missing, malformed, unknown, expired or revoked token (every `/v1` route);
/// - 403: a role or token scope that does not allow a change;
/// - 404: an id (in the path, the body or a filter) that does not exist or belongs to
///   another team;
/// - 409: an `Idempotency-Key` reused with another body;
/// - 413 / 415: a body too large or not JSON;
/// - 422: a value that parses but is not valid (U+0000 in any string among them);
/// - 500: an unexpected failure (opaque; the chain is in the server log);
/// - 503: the database is unavailable, or the server is shutting down.
fn error_statuses(shape: &Shape) -> Vec<u16> {
    if !shape.authenticated {
        return Vec::new();
    }
    let mut out = vec![401, 500, 503];
    if shape.has_inputs {
        out.extend([400, 422]);
    }
    if !shape.reads_only {
        out.push(403);
    }
    if shape.has_path_params || shape.has_body || shape.names_ids {
        out.push(404);
    }
    if shape.has_body {
        out.extend([413, 415]);
    }
    if shape.idempotent {
        out.push(409);
    }
    out
}

fn complete_operation(path: &str, method: &str, op: &mut Map<String, Value>) {
    let shape = Shape::of(path, method, op);
    let op_id = op
        .get("operationId")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let responses = op
        .entry("responses")
        .or_insert_with(|| json!({}))
        .as_object_mut()
        .expect("responses is an object");
    for status in error_statuses(&shape) {
        responses
            .entry(status.to_string())
            .or_insert_with(|| json!({}));
    }
    for (status, response) in responses.iter_mut() {
        let Ok(status) = status.parse::<u16>() else {
            continue;
        };
        if status < 400 {
            continue;
        }
        let response = response.as_object_mut().expect("a response is an object");
        if response.get("description").is_none_or(|d| d == "") {
            response.insert("description".into(), json!(description(status)));
        }
        response.insert(
            "content".into(),
            json!({ PROBLEM_JSON: {
                "schema": {"$ref": "#/components/schemas/Problem"},
                "example": example(status, &op_id),
            }}),
        );
    }
}

fn description(status: u16) -> &'static str {
    match status {
        400 => "The request does not parse (query, header or JSON body)",
        401 => "Missing or invalid credentials",
        403 => "The caller's role or token scopes do not allow this",
        404 => "No such resource, or one of another team",
        405 => "Method not allowed",
        409 => "The resource's state does not allow this now",
        413 => "The body is too large",
        415 => "The body is not JSON",
        422 => "A value is not valid",
        500 => "An unexpected failure (details are in the server log)",
        502 => "The project's git remote or forge failed or refused",
        503 => "The database is unavailable or the server is stopping; retry later",
        _ => "An error",
    }
}

fn example(status: u16, op_id: &str) -> Value {
    let (code, detail) = match (status, op_id) {
        (409, "send_message") => (
            "agent_busy",
            "a turn is running; wait for it or interrupt it (sent with \"queue\": false)",
        ),
        (409, "cancel_message") => (
            "message_not_queued",
            "the message is no longer queued (it is started)",
        ),
        (409, "answer_permission") => (
            "permission_already_resolved",
            "the permission request was already answered",
        ),
        (409, "delete_project") => (
            "project_has_workspaces",
            "archive the project's workspaces before deleting it",
        ),
        (409, "set_member" | "remove_member") => (
            "last_owner",
            "a team keeps at least one owner: add another owner first",
        ),
        (409, "approve_device" | "deny_device") => {
            ("device_code_answered", "this request was already answered")
        }
        (400, "collect_device_token") => (
            "authorization_pending",
            "the request is not answered yet; poll again in `interval` seconds",
        ),
        (400, "describe_device_request" | "approve_device" | "deny_device") => (
            "expired_token",
            "the device code expired; run the sign-in again",
        ),
        (
            404,
            "collect_device_token" | "describe_device_request" | "approve_device" | "deny_device",
        ) => ("not_found", "device code not found"),
        (429, "start_device_sign_in") => (
            "too_many_requests",
            "too many sign-in codes requested from this address; retry in a minute",
        ),
        (409, "create_team") => ("team_name_taken", "a team with this name already exists"),
        (409, "create_user") => ("user_email_taken", "a user with this email already exists"),
        (403, "list_audit") => (
            "forbidden",
            "the audit log is for team owners and server admins",
        ),
        (403, "list_users") => (
            "forbidden",
            "team owners look users up by exact email: pass `email`",
        ),
        (409, "push_workspace") => (
            "push_rejected",
            "the remote refused the push: non-fast-forward: the remote branch has commits the \
             workspace lacks; push with \"force\": true to replace them",
        ),
        (401, "receive_delivery") => (
            "signature_invalid",
            "X-Hub-Signature-256 is missing or is not the HMAC-SHA256 of the body with the \
             trigger's secret",
        ),
        (413, "receive_delivery") => (
            "payload_too_large",
            "a delivery is at most 1048576 bytes (triggers.max_body_bytes)",
        ),
        (409, "workspace_pull_request") => (
            "not_pushed",
            "push the workspace before opening a pull request",
        ),
        (502, "push_workspace") => (
            "remote_unavailable",
            "the push did not reach the remote: git push: no answer within 120 s",
        ),
        (502, "workspace_pull_request") => (
            "forge_failed",
            "the forge refused the request (401): Bad credentials",
        ),
        (409, "workspace_diff" | "list_models") => (
            "workspace_archived",
            "the workspace is archived; its files are gone",
        ),
        (status, _) => match status {
            400 => (
                "invalid_json",
                "malformed JSON: expected value at line 1 column 1",
            ),
            401 => ("token_missing", "send `Authorization: Bearer <token>`"),
            403 => (
                "insufficient_scope",
                "this token's scopes (read) do not allow this; it needs `agents`",
            ),
            404 => ("not_found", "agent not found"),
            409 => (
                "idempotency_key_reused",
                "this Idempotency-Key was used with a different request body",
            ),
            413 => ("payload_too_large", "the body is larger than 1048576 bytes"),
            415 => (
                "unsupported_media_type",
                "send the body as application/json",
            ),
            422 => ("validation_failed", "text: must not contain U+0000"),
            500 => (
                "internal",
                "an unexpected error occurred; see the server log",
            ),
            503 => (
                "store_unavailable",
                "the database is unavailable; retry later",
            ),
            _ => ("error", "an error"),
        },
    };
    let mut title = code.replace('_', " ");
    if let Some(first) = title.get_mut(0..1) {
        first.make_ascii_uppercase();
    }
    let mut v = json!({
        "type": format!("https://agentry.dev/problems/{code}"),
        "title": title,
        "status": status,
        "detail": detail,
        "code": code,
    });
    if status == 422 {
        v["errors"] = json!([{"field": "text", "message": "must not contain U+0000"}]);
    }
    v
}

/// One link: from a response of `from` to the operation `to`.
struct LinkSpec {
    from: (&'static str, &'static str),
    statuses: &'static [&'static str],
    name: &'static str,
    to: &'static str,
    parameters: Value,
    body: Option<Value>,
}

const ID: &str = "$response.body#/id";
const FIRST_ITEM_ID: &str = "$response.body#/items/0/id";
const PATH_ID: &str = "$request.path.id";

fn links() -> Vec<LinkSpec> {
    let link = |from: (&'static str, &'static str),
                statuses: &'static [&'static str],
                name: &'static str,
                to: &'static str,
                parameters: Value,
                body: Option<Value>| LinkSpec {
        from,
        statuses,
        name,
        to,
        parameters,
        body,
    };
    const CREATED: &[&str] = &["201", "200"];
    const OK: &[&str] = &["200"];
    const ACCEPTED: &[&str] = &["202"];
    let project_create = ("/v1/projects", "post");
    let project_list = ("/v1/projects", "get");
    let project_get = ("/v1/projects/{id}", "get");
    let workspace_create = ("/v1/workspaces", "post");
    let workspace_get = ("/v1/workspaces/{id}", "get");
    let agent_create = ("/v1/agents", "post");
    let agent_get = ("/v1/agents/{id}", "get");
    let agent_message = ("/v1/agents/{id}/messages", "post");
    let permissions = ("/v1/agents/{id}/permissions", "get");
    let token_create = ("/v1/tokens", "post");
    let team_create = ("/v1/teams", "post");
    let user_create = ("/v1/users", "post");
    let mock_agent = |source: &'static str| {
        Some(
            json!({"workspace_id": source, "provider": "mock", "workspace": null,
            "model": null, "mode": null, "mcp_servers": {}, "prompt": null, "labels": {},
            "title": null, "system_prompt": null}),
        )
    };
    let mut out = Vec::new();
    // Projects lead to workspaces.
    for (from, statuses, id) in [
        (project_create, CREATED, ID),
        (project_get, OK, ID),
        (project_list, OK, FIRST_ITEM_ID),
    ] {
        out.push(link(
            from,
            statuses,
            "GetProject",
            "get_project",
            json!({"id": id}),
            None,
        ));
        out.push(link(
            from,
            statuses,
            "CreateWorkspace",
            "create_workspace",
            json!({}),
            Some(
                json!({"project_id": id, "kind": "worktree", "base_ref": null, "branch": null,
                "title": null}),
            ),
        ));
        out.push(link(
            from,
            statuses,
            "ListWorkspaces",
            "list_workspaces",
            json!({"project_id": id}),
            None,
        ));
    }
    // Workspaces lead to their diff, their agents and their archive.
    for (from, statuses) in [(workspace_create, CREATED), (workspace_get, OK)] {
        out.push(link(
            from,
            statuses,
            "GetWorkspace",
            "get_workspace",
            json!({"id": ID}),
            None,
        ));
        out.push(link(
            from,
            statuses,
            "WorkspaceDiff",
            "workspace_diff",
            json!({"id": ID}),
            None,
        ));
        out.push(link(
            from,
            statuses,
            "CreateAgent",
            "create_agent",
            json!({}),
            mock_agent(ID),
        ));
        out.push(link(
            from,
            statuses,
            "ListAgents",
            "list_agents",
            json!({"workspace_id": ID}),
            None,
        ));
    }
    out.push(link(
        workspace_create,
        CREATED,
        "ArchiveWorkspace",
        "archive_workspace",
        json!({"id": ID}),
        None,
    ));
    // Agents lead to everything that drives them.
    let agent_ops: [(&str, &str, Option<Value>); 11] = [
        ("GetAgent", "get_agent", None),
        ("SendMessage", "send_message", None),
        (
            "AskPermission",
            "send_message",
            Some(json!({"text": "/ask deploy?"})),
        ),
        ("Interrupt", "interrupt_agent", None),
        ("Wait", "wait_agent", None),
        ("Timeline", "timeline", None),
        ("Permissions", "list_permissions", None),
        ("SetMode", "set_mode", Some(json!({"mode": "unattended"}))),
        (
            "SetModel",
            "set_model",
            Some(json!({"model": "mock-large"})),
        ),
        ("Close", "close_agent", None),
        ("Archive", "archive_agent", None),
    ];
    for (from, statuses, id) in [
        (agent_create, CREATED, ID),
        (agent_get, OK, ID),
        (agent_message, ACCEPTED, PATH_ID),
    ] {
        for (name, to, body) in &agent_ops {
            out.push(link(
                from,
                statuses,
                name,
                to,
                json!({"id": id}),
                body.clone(),
            ));
        }
    }
    // A pending permission can be answered.
    out.push(link(
        permissions,
        OK,
        "AnswerPermission",
        "answer_permission",
        json!({"id": PATH_ID, "request_id": "$response.body#/items/0/request_id"}),
        None,
    ));
    // A team leads to its members and its audit log; a user to their first token.
    for (name, to, params) in [
        ("GetTeam", "get_team", json!({"id": ID})),
        ("ListMembers", "list_members", json!({"id": ID})),
        ("TeamAudit", "list_audit", json!({"team_id": ID})),
    ] {
        out.push(link(team_create, CREATED, name, to, params, None));
    }
    out.push(link(
        user_create,
        CREATED,
        "IssueToken",
        "create_user_token",
        json!({"id": ID}),
        None,
    ));
    // A token a client created can be revoked (never one it did not create: revoking
    // its own credentials would end the client's session).
    out.push(link(
        token_create,
        CREATED,
        "RevokeToken",
        "revoke_token",
        json!({"id": ID}),
        None,
    ));
    out
}

fn add_links(paths: &mut Map<String, Value>) {
    for spec in links() {
        let Some(op) = paths
            .get_mut(spec.from.0)
            .and_then(|item| item.get_mut(spec.from.1))
        else {
            panic!(
                "link source {} {} is not in the document",
                spec.from.1, spec.from.0
            );
        };
        for status in spec.statuses {
            let Some(response) = op
                .get_mut("responses")
                .and_then(|r| r.get_mut(*status))
                .and_then(Value::as_object_mut)
            else {
                continue;
            };
            let mut link = json!({"operationId": spec.to, "parameters": spec.parameters});
            if let Some(body) = &spec.body {
                link["requestBody"] = body.clone();
            }
            response
                .entry("links")
                .or_insert_with(|| json!({}))
                .as_object_mut()
                .expect("links is an object")
                .insert(spec.name.into(), link);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(path: &str, method: &str, op: Value) -> Shape {
        Shape::of(path, method, op.as_object().unwrap())
    }

    #[test]
    fn statuses_follow_the_shape_of_the_operation() {
        let me = shape("/v1/me", "get", json!({}));
        assert_eq!(error_statuses(&me), vec![401, 500, 503]);
        let create = shape(
            "/v1/agents",
            "post",
            json!({"requestBody": {}, "parameters": [{"name": "Idempotency-Key", "in": "header"}]}),
        );
        let mut s = error_statuses(&create);
        s.sort_unstable();
        assert_eq!(s, vec![400, 401, 403, 404, 409, 413, 415, 422, 500, 503]);
        let list = shape(
            "/v1/workspaces",
            "get",
            json!({"parameters": [{"name": "project_id", "in": "query"}]}),
        );
        assert!(error_statuses(&list).contains(&404));
        assert!(!error_statuses(&list).contains(&403));
        assert!(error_statuses(&shape("/healthz", "get", json!({}))).is_empty());
    }

    #[test]
    fn every_error_answer_is_problem_json_and_every_link_resolves() {
        let doc = serde_json::to_value(super::super::docs::document()).unwrap();
        let mut operation_ids = Vec::new();
        for item in doc["paths"].as_object().unwrap().values() {
            for op in item.as_object().unwrap().values() {
                operation_ids.push(op["operationId"].as_str().unwrap().to_owned());
            }
        }
        let mut links = 0;
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                for (status, response) in op["responses"].as_object().unwrap() {
                    let code: u16 = status.parse().unwrap();
                    if code >= 400 {
                        let content = response["content"].as_object().unwrap();
                        assert_eq!(
                            content.keys().collect::<Vec<_>>(),
                            vec![PROBLEM_JSON],
                            "{method} {path} {status}"
                        );
                        assert!(content[PROBLEM_JSON]["example"].is_object());
                    }
                    for link in response
                        .get("links")
                        .and_then(Value::as_object)
                        .into_iter()
                        .flat_map(|l| l.values())
                    {
                        let target = link["operationId"].as_str().unwrap();
                        assert!(operation_ids.iter().any(|o| o == target), "{target}");
                        links += 1;
                    }
                }
            }
        }
        assert!(links > 30, "only {links} links");
    }
}
