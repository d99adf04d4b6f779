//! The cross-team access matrix, generated from the route table: the OpenAPI document
//! the server serves lists every operation (it is built from the handlers, so a new route
//! is covered here without anyone remembering to add it). For every `/v1` operation the
//! path, id filters and id fields of the body are filled with team A's resources, and:
//! (a) the owner of team B (a member of team B can do no more) gets 404 on every route
//!     that names a team-A resource, and no answer anywhere carries a team-A id;
//! (b) a viewer of team A gets 403 on every changing route that names a team-A resource,
//!     and an answer on its reads, except those the route table reserves for owners;
//! (c) a `read`-scoped token of team A's owner gets 403 `insufficient_scope` on every
//!     changing route;
//! routes only a server admin may call refuse both outsiders with 403. Afterwards team
//! A's resources are as they were, and team B's activity stream never carried team A's.
//! A route with a path parameter or an id filter the matrix does not know how to fill
//! fails the test, naming it: that is how a new route forces an update here. Every
//! failure is collected and reported with its route.

use std::collections::BTreeMap;
use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;
use crate::people::*;

/// Team A's resources, by the kind of id that names them.
struct TeamA {
    project: String,
    workspace: String,
    agent: String,
    permission: String,
    /// A follow-up queued behind the agent's turn.
    message: String,
    service_token: String,
    service_token_secret: String,
    team: String,
    owner_id: String,
    hook: String,
    delivery: String,
    trigger: String,
}

impl TeamA {
    /// Every id of team A's resources (user ids are not a team's resources).
    fn ids(&self) -> [&str; 9] {
        [
            &self.project,
            &self.workspace,
            &self.agent,
            &self.permission,
            &self.service_token,
            &self.team,
            &self.hook,
            &self.delivery,
            &self.trigger,
        ]
    }
}

/// One operation, ready to call.
struct Call {
    /// `METHOD /path/{template} (operation id)`, for the report.
    label: String,
    /// The method and path template, as the route table declares them.
    route: (String, String),
    method: Method,
    path: String,
    body: Option<Value>,
    /// It names a resource of team A (in its path, a filter or its body).
    names_team_a: bool,
}

fn method_of(m: &str) -> Method {
    Method::from_bytes(m.to_uppercase().as_bytes()).unwrap()
}

/// The value for path parameter `name` of `path`, and whether it is a team-A resource.
fn path_value(a: &TeamA, path: &str, name: &str) -> Option<(String, bool)> {
    let collection = path
        .trim_start_matches("/v1/")
        .split('/')
        .next()
        .unwrap_or("");
    Some(match (name, collection) {
        ("id", "projects") => (a.project.clone(), true),
        ("id", "workspaces") => (a.workspace.clone(), true),
        ("id", "agents") => (a.agent.clone(), true),
        ("id", "tokens") => (a.service_token.clone(), true),
        ("id", "teams") => (a.team.clone(), true),
        ("id", "users") => (a.owner_id.clone(), false),
        ("id", "providers") => ("mock".to_owned(), false),
        ("request_id", "agents") => (a.permission.clone(), true),
        ("message_id", "agents") => (a.message.clone(), true),
        ("user_id", "teams") => (a.owner_id.clone(), false),
        ("name", "teams") => (MATRIX_SECRET.to_owned(), true),
        ("id", "hooks") => (a.hook.clone(), true),
        ("delivery_id", "hooks") => (a.delivery.clone(), true),
        ("id", "triggers") => (a.trigger.clone(), true),
        _ => return None,
    })
}

/// The name of a secret team A has set.
const MATRIX_SECRET: &str = "MATRIX_SECRET";

/// The value of an id filter or an id field of a body.
fn id_value(a: &TeamA, name: &str) -> Option<String> {
    Some(match name {
        "project_id" => a.project.clone(),
        "workspace_id" => a.workspace.clone(),
        "agent_id" | "parent_agent_id" => a.agent.clone(),
        "team_id" => a.team.clone(),
        "actor_id" => a.owner_id.clone(),
        _ => return None,
    })
}

/// Query parameters named like ids that do not name a resource, with what they are.
const NOT_RESOURCES: &[(&str, &str)] = &[("after_id", "a resume point of a stream")];

/// Every `/v1` operation of the document, filled with team A's resources. Panics,
/// naming the route, when a parameter cannot be filled.
fn calls(doc: &Value, a: &TeamA) -> Vec<Call> {
    let schemas = &doc["components"]["schemas"];
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        if !path.starts_with("/v1/") {
            continue;
        }
        for (method, op) in item.as_object().unwrap() {
            let label = format!("{} {path}", method.to_uppercase());
            let mut names_team_a = false;
            let mut concrete = path.clone();
            let mut query = Vec::new();
            for p in op["parameters"].as_array().into_iter().flatten() {
                let name = p["name"].as_str().unwrap();
                match p["in"].as_str().unwrap() {
                    "path" => {
                        let (v, team_a) = path_value(a, path, name).unwrap_or_else(|| {
                            panic!("{label}: the matrix does not know how to fill path parameter `{name}`; teach path_value")
                        });
                        names_team_a |= team_a;
                        concrete = concrete.replace(&format!("{{{name}}}"), &v);
                    }
                    "query" if NOT_RESOURCES.iter().any(|(n, _)| *n == name) => {}
                    "query" if name.ends_with("_id") => {
                        let v = id_value(a, name).unwrap_or_else(|| {
                            panic!("{label}: the matrix does not know how to fill the id filter `{name}`; teach id_value")
                        });
                        names_team_a |= name != "actor_id";
                        query.push(format!("{name}={v}"));
                    }
                    "query" if name == "timeout_s" => query.push("timeout_s=1".into()),
                    _ => {}
                }
            }
            if !query.is_empty() {
                concrete = format!("{concrete}?{}", query.join("&"));
            }
            let body = op.get("requestBody").map(|rb| {
                let schema = &rb["content"]["application/json"]["schema"];
                let name = schema["$ref"]
                    .as_str()
                    .and_then(|r| r.rsplit('/').next())
                    .unwrap_or_else(|| panic!("{label}: a request body without a named schema"));
                let schema = &schemas[name];
                let mut body = schema.get("example").cloned().unwrap_or_else(|| {
                    panic!("{label}: schema {name} has no example to build a body from")
                });
                for field in schema["properties"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, _)| k)
                {
                    if let Some(v) = id_value(a, field).filter(|_| field != "actor_id") {
                        body[field] = json!(v);
                        names_team_a = true;
                    }
                }
                body
            });
            out.push(Call {
                label: format!("{label} ({})", op["operationId"].as_str().unwrap()),
                route: (method.to_uppercase(), path.clone()),
                method: method_of(method),
                path: concrete,
                body,
                names_team_a,
            });
        }
    }
    out
}

/// The operation the route table declares for `call`.
fn declared(call: &Call) -> Option<agentry::auth::Operation> {
    agentry::api::access::operation(&call.route.0, &call.route.1)
}

/// Routes only a server admin may call: everyone else gets 403 whatever they name.
fn admin_only(call: &Call) -> bool {
    declared(call) == Some(agentry::auth::Operation::AdministerServer)
}

/// Choices a person makes for themselves among their own teams (their default team): a
/// viewer of team A may make them, so they count as answers, not refusals.
fn own_choice(call: &Call) -> bool {
    call.method == Method::PUT && call.path == "/v1/me/default-team"
}

/// Reads the table reserves for owners (the audit log): a viewer gets 403.
fn owner_only_read(call: &Call) -> bool {
    declared(call).and_then(|op| op.role()) == Some(agentry::auth::Role::Owner)
}

#[tokio::test]
async fn no_route_lets_another_team_or_a_lower_role_or_a_narrower_token_through() {
    let app = spawn_app().await;
    let ana = person(&app, "ana").await; // owner of team A
    let vic = person(&app, "vic").await; // viewer in team A
    let bob = person(&app, "bob").await; // owner of team B
    let team_a = team(&ana, "alpha").await;
    let team_b = team(&bob, "beta").await;
    add(&ana, &team_a, &vic, "viewer").await;

    // Team A: a project, a workspace, an agent waiting on a permission request, a
    // service token.
    let repo = git_repo();
    // Registering a local repository is a server admin's part.
    let admin = Caller::new(&app, &app.token);
    let project = admin
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "web", "team_id": team_a, "repo_path": repo.path()})),
            201,
        )
        .await;
    // A hook of team A (its receiver does not exist: its delivery stays pending).
    let hook = ana
        .api
        .ok(
            Method::POST,
            "/v1/hooks",
            Some(
                json!({"name": "matrix", "events": ["workspace.create.after"],
                "url": "https://hooks.invalid/matrix", "secret": "matrix-hook-secret"}),
            ),
            201,
        )
        .await;
    let hook = hook["id"].as_str().unwrap().to_owned();
    // A webhook trigger of team A.
    let trigger = ana
        .api
        .ok(
            Method::POST,
            "/v1/triggers",
            Some(
                json!({"name": "matrix", "kind": "github", "project_id": project["id"],
                "provider": "mock"}),
            ),
            201,
        )
        .await;
    let trigger = trigger["id"].as_str().unwrap().to_owned();
    let ws = ana
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"]})),
            201,
        )
        .await;
    let mut delivery = None;
    for _ in 0..100 {
        let d = ana
            .api
            .ok(
                Method::GET,
                &format!("/v1/hooks/{hook}/deliveries"),
                None,
                200,
            )
            .await;
        if let Some(id) = d["items"][0]["id"].as_str() {
            delivery = Some(id.to_owned());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let agent = ana
        .api
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws["id"], "provider": "mock", "prompt": "/ask deploy?"})),
            201,
        )
        .await;
    let agent_id = agent["id"].as_str().unwrap().to_owned();
    let mut permission = None;
    for _ in 0..300 {
        let p = ana
            .api
            .ok(
                Method::GET,
                &format!("/v1/agents/{agent_id}/permissions?status=pending"),
                None,
                200,
            )
            .await;
        if let Some(r) = p["items"][0]["request_id"].as_str() {
            permission = Some(r.to_owned());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let queued = ana
        .api
        .ok(
            Method::POST,
            &format!("/v1/agents/{agent_id}/messages"),
            Some(json!({"text": "after the answer"})),
            202,
        )
        .await;
    let svc = ana
        .api
        .ok(
            Method::POST,
            "/v1/tokens",
            Some(json!({"name": "ci", "team_id": team_a})),
            201,
        )
        .await;
    ana.api
        .ok(
            Method::PUT,
            &format!("/v1/teams/{team_a}/secrets/{MATRIX_SECRET}"),
            Some(json!({"value": "matrix-secret-value"})),
            201,
        )
        .await;
    let a = TeamA {
        project: project["id"].as_str().unwrap().to_owned(),
        workspace: ws["id"].as_str().unwrap().to_owned(),
        agent: agent_id.clone(),
        permission: permission.expect("the agent asked"),
        message: queued["message_id"].as_str().unwrap().to_owned(),
        service_token: svc["id"].as_str().unwrap().to_owned(),
        service_token_secret: svc["token"].as_str().unwrap().to_owned(),
        team: team_a.clone(),
        owner_id: ana.id.clone(),
        hook: hook.clone(),
        delivery: delivery.expect("the hook has a delivery"),
        trigger,
    };
    let read_token = ana
        .api
        .ok(
            Method::POST,
            "/v1/tokens",
            Some(json!({"name": "watcher", "scopes": ["read"]})),
            201,
        )
        .await;
    let reader = Caller::new(&app, read_token["token"].as_str().unwrap());
    // Team B has work of its own, so its lists are not trivially empty.
    let repo_b = git_repo();
    let project_b = admin
        .ok(
            Method::POST,
            "/v1/projects",
            Some(json!({"name": "api", "team_id": team_b, "repo_path": repo_b.path()})),
            201,
        )
        .await;
    // Bob watches his team's activity from here on.
    let bob_events = app
        .client
        .get(app.url("/v1/events"))
        .bearer_auth(&bob.api.token)
        .send()
        .await
        .unwrap();
    assert_eq!(bob_events.status(), 200);
    let mut bob_events = SseReader::from_response(bob_events);

    let doc: Value = app
        .client
        .get(app.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let calls = calls(&doc, &a);
    assert!(calls.len() >= 40, "only {} operations", calls.len());
    let mut failures: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut fail = |call: &Call, who: &str, why: String| {
        failures
            .entry(call.label.clone())
            .or_default()
            .push(format!("{who}: {why}"));
    };
    for call in &calls {
        let mutating = call.method != Method::GET;
        // (a) The owner of team B.
        let (status, body) = bob
            .api
            .call(call.method.clone(), &call.path, call.body.clone())
            .await;
        let text = body.to_string();
        if let Some(id) = a.ids().into_iter().find(|id| text.contains(id)) {
            fail(
                call,
                "team B's owner",
                format!("the answer carries team A's {id}: {text}"),
            );
        }
        if call.names_team_a {
            let expected = if admin_only(call) {
                (403, "forbidden")
            } else {
                (404, "not_found")
            };
            if (status, body["code"].as_str().unwrap_or("")) != expected {
                fail(
                    call,
                    "team B's owner",
                    format!("expected {expected:?}, got {status} {text}"),
                );
            }
        } else if admin_only(call) && status != 403 {
            fail(
                call,
                "team B's owner",
                format!("expected 403 on an admin route, got {status} {text}"),
            );
        } else if status >= 500 {
            fail(call, "team B's owner", format!("got {status} {text}"));
        }
        // (b) A viewer of team A.
        let (status, body) = vic
            .api
            .call(call.method.clone(), &call.path, call.body.clone())
            .await;
        if call.names_team_a {
            if (mutating && !own_choice(call)) || owner_only_read(call) {
                if (status, body["code"].as_str()) != (403, Some("forbidden")) {
                    fail(
                        call,
                        "team A's viewer",
                        format!("expected 403 forbidden, got {status} {body}"),
                    );
                }
            } else if !(200..300).contains(&status) {
                fail(
                    call,
                    "team A's viewer",
                    format!("expected an answer, got {status} {body}"),
                );
            }
        } else if admin_only(call) && status != 403 {
            fail(
                call,
                "team A's viewer",
                format!("expected 403 on an admin route, got {status} {body}"),
            );
        } else if status >= 500 {
            fail(call, "team A's viewer", format!("got {status} {body}"));
        }
        // (c) A `read` token of team A's owner.
        let (status, body) = reader
            .call(call.method.clone(), &call.path, call.body.clone())
            .await;
        let code = body["code"].as_str().unwrap_or("");
        if mutating && (status, code) != (403, "insufficient_scope") {
            fail(
                call,
                "a read token",
                format!("expected 403 insufficient_scope, got {status} {body}"),
            );
        }
        if !mutating && (code == "insufficient_scope" || status >= 500) {
            fail(
                call,
                "a read token",
                format!("a read was refused: {status} {body}"),
            );
        }
    }
    let report: Vec<String> = failures
        .iter()
        .map(|(route, why)| format!("{route}\n    {}", why.join("\n    ")))
        .collect();
    assert!(
        report.is_empty(),
        "{} of {} routes let someone through:\n{}",
        report.len(),
        calls.len(),
        report.join("\n")
    );

    // Nothing a refused request would have done happened.
    let agent = ana
        .api
        .ok(Method::GET, &format!("/v1/agents/{agent_id}"), None, 200)
        .await;
    assert!(agent["archived_at"].is_null(), "{agent}");
    let pending = ana
        .api
        .ok(
            Method::GET,
            &format!("/v1/agents/{agent_id}/permissions?status=pending"),
            None,
            200,
        )
        .await;
    assert_eq!(pending["items"][0]["request_id"], a.permission.as_str());
    let ws_now = ana
        .api
        .ok(
            Method::GET,
            &format!("/v1/workspaces/{}", a.workspace),
            None,
            200,
        )
        .await;
    assert_eq!(ws_now["status"], "active");
    ana.api
        .ok(
            Method::GET,
            &format!("/v1/projects/{}", a.project),
            None,
            200,
        )
        .await;
    Caller::new(&app, &a.service_token_secret)
        .ok(Method::GET, "/v1/me", None, 200)
        .await;
    let members = ana
        .api
        .ok(
            Method::GET,
            &format!("/v1/teams/{team_a}/members"),
            None,
            200,
        )
        .await;
    let roles: Vec<(&str, &str)> = members["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["email"].as_str().unwrap(), m["role"].as_str().unwrap()))
        .collect();
    assert_eq!(roles.len(), 2, "{members}");
    assert!(
        roles.contains(&("ana@example.com", "owner"))
            && roles.contains(&("vic@example.com", "viewer"))
    );

    // Team B's activity stream never carried team A's: new activity in A, then a marker
    // in B; everything Bob's stream shows up to the marker is team B's.
    ana.api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": a.project, "title": "after the matrix"})),
            201,
        )
        .await;
    let marker = bob
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project_b["id"]})),
            201,
        )
        .await;
    let marker = marker["id"].as_str().unwrap();
    let mut seen = Vec::new();
    loop {
        let e = bob_events
            .next(Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("no marker on team B's stream; got {seen:?}"));
        let text = e.data.to_string();
        if let Some(id) = a.ids().into_iter().find(|id| text.contains(id)) {
            panic!("team B's stream carried team A's {id}: {text}");
        }
        assert_eq!(e.data["data"]["project_id"], project_b["id"], "{text}");
        seen.push(e.event.clone());
        if text.contains(marker) {
            break;
        }
    }
}
