//! `/mcp`: a real MCP client (the pinned Python SDK) drives agents through the tools, and
//! the transport's edges (authentication, sessions, methods) answer as the spec says.

use std::path::PathBuf;
use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use super::helpers::{git_repo, spawn_app};
use super::people::{Caller, person, team};

/// The Python of the virtual environment `.ci/install-test-peers` makes for the client.
fn mcp_python() -> PathBuf {
    let cache = std::env::var_os("AGENTRY_TEST_PEERS_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                .join(".cache/agentry/test-peers")
        });
    let venv = cache.join("mcp-python@2.3.0");
    assert!(
        venv.join(".installed").exists(),
        "the MCP client test peer is missing from {}: run .ci/install-test-peers",
        venv.display()
    );
    venv.join("bin/python")
}

/// A plain member with a team and a workspace of their own (the admin adds the
/// repository): `(member, project id, workspace id, the repository)`.
async fn member_with_workspace(
    app: &super::helpers::TestApp,
    name: &str,
) -> (super::people::Person, String, String, tempfile::TempDir) {
    let member = person(app, name).await;
    let team = team(&member, &format!("{name}-team")).await;
    let repo = git_repo();
    let admin = Caller::new(app, &app.token);
    let project = admin
        .ok(
            Method::POST,
            "/v1/projects",
            Some(
                json!({"name": format!("{name}-repo"), "repo_path": repo.path(), "team_id": team}),
            ),
            201,
        )
        .await;
    let ws = member
        .api
        .ok(
            Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"]})),
            201,
        )
        .await;
    (
        member,
        project["id"].as_str().unwrap().to_owned(),
        ws["id"].as_str().unwrap().to_owned(),
        repo,
    )
}

#[tokio::test]
async fn a_real_mcp_client_opens_waits_reads_answers_and_archives_a_mock_agent() {
    let app = spawn_app().await;
    let (alice, project, workspace, _repo) = member_with_workspace(&app, "alice").await;
    let (bob, _, bob_workspace, _bob_repo) = member_with_workspace(&app, "bob").await;
    let foreign = bob
        .api
        .ok(
            Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": bob_workspace, "provider": "mock"})),
            201,
        )
        .await;

    let run = tokio::process::Command::new(mcp_python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/support/mcp_client.py"
        ))
        .env_clear()
        .env("MCP_CLIENT_URL", app.url("/mcp"))
        .env("MCP_CLIENT_TOKEN", &alice.api.token)
        .env("PROJECT_ID", &project)
        .env("WORKSPACE_ID", &workspace)
        .env("FOREIGN_AGENT_ID", foreign["id"].as_str().unwrap())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the MCP client finishes within 2 minutes")
        .unwrap();
    assert!(
        output.status.success(),
        "the MCP client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let out: Value = serde_json::from_slice(&output.stdout).unwrap();

    assert_eq!(out["server_name"], "agentry");
    assert!(
        agentry::api::mcp::PROTOCOL_VERSIONS.contains(&out["protocol_version"].as_str().unwrap()),
        "{}",
        out["protocol_version"]
    );
    let mut names: Vec<&str> = out["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "answer_permission",
            "archive_agent",
            "create_agent",
            "create_workspace",
            "get_diff",
            "get_timeline",
            "interrupt_agent",
            "list_providers",
            "list_workspaces",
            "send_message",
            "wait_for_agent",
        ]
    );
    tool_schemas_agree_with_the_openapi_document(&out["tools"]);

    let created = &out["create_agent"];
    assert_eq!(created["is_error"], false, "{created}");
    let agent = out["agent_id"].as_str().unwrap();
    assert!(agent.starts_with("agt_"), "{agent}");
    assert_eq!(created["structured"]["labels"], json!({"via": "mcp"}));
    assert_eq!(created["structured"]["workspace_id"], workspace.as_str());

    let asking = &out["wait_asking"];
    assert_eq!(asking["is_error"], false, "{asking}");
    assert_eq!(
        asking["structured"]["status"], "waiting_permission",
        "{asking}"
    );
    let pending = asking["structured"]["pending_permissions"]
        .as_array()
        .unwrap();
    assert_eq!(pending.len(), 1, "{asking}");
    assert_eq!(pending[0]["title"], "deploy?");
    let request = pending[0]["request_id"].as_str().unwrap();
    assert!(
        asking["text"].as_str().unwrap().contains(request),
        "the text names the request to answer: {asking}"
    );

    let answered = &out["answer_permission"];
    assert_eq!(answered["is_error"], false, "{answered}");
    assert_eq!(answered["structured"]["status"], "resolved");

    let done = &out["wait_done"];
    assert_eq!(done["structured"]["status"], "idle", "{done}");
    assert_eq!(done["structured"]["timed_out"], false);
    assert_eq!(done["structured"]["last_turn"]["outcome"], "completed");
    let reply = done["structured"]["last_assistant_message"]
        .as_str()
        .unwrap();
    assert!(
        reply.contains("allow"),
        "the mock reports the answer it got: {reply}"
    );
    assert!(done["text"].as_str().unwrap().contains(reply), "{done}");

    // The timeline tool answers the API's page and a compact rendering of it.
    let page = &out["get_timeline"];
    assert_eq!(page["is_error"], false);
    let rest = app
        .get_ok(&format!("/v1/agents/{agent}/timeline?limit=1000"))
        .await;
    // (Archiving appended events since the tool read its page.)
    let items = page["structured"]["items"].as_array().unwrap();
    assert_eq!(
        items[..],
        rest["items"].as_array().unwrap()[..items.len()],
        "the tool's page is the route's page"
    );
    let text = page["text"].as_str().unwrap();
    for line in [
        "user: /ask deploy?".to_owned(),
        format!("permission {request} requested: deploy?"),
        format!("permission {request} answered allow"),
        format!("assistant: {reply}"),
    ] {
        assert!(text.contains(&line), "{line:?} missing from:\n{text}");
    }
    assert!(
        !text.contains("assistant_delta"),
        "streaming chunks are left out: {text}"
    );
    assert!(
        text.ends_with("(end of timeline in this direction)"),
        "{text}"
    );

    // Another team's agent does not exist for this caller.
    let foreign_read = &out["foreign_timeline"];
    assert_eq!(foreign_read["is_error"], true, "{foreign_read}");
    assert_eq!(foreign_read["structured"]["code"], "not_found");
    assert_eq!(foreign_read["structured"]["status"], 404);
    // Arguments outside the request type are refused like the route's body.
    let bad = &out["bad_arguments"];
    assert_eq!(bad["is_error"], true, "{bad}");
    assert_eq!(bad["structured"]["code"], "validation_failed", "{bad}");

    assert_eq!(out["archive_agent"]["is_error"], false);
    let archived = app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert!(!archived["archived_at"].is_null(), "{archived}");
    // The audit log names the person behind the tool calls.
    let audit = app.get_ok("/v1/audit?limit=200").await;
    let prompts: Vec<&Value> = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "permission.answer" && e["actor"]["id"] == alice.id.as_str())
        .collect();
    assert_eq!(prompts.len(), 1, "{audit}");

    // The rest of the tools, on a second agent in a workspace the tools made.
    let providers = &out["list_providers"]["structured"]["items"];
    let mock = providers
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == "mock")
        .unwrap();
    assert_eq!(mock["available"], true);
    let made = &out["create_workspace"];
    assert_eq!(made["is_error"], false, "{made}");
    assert_eq!(made["structured"]["project_id"], project.as_str());
    assert_eq!(made["structured"]["title"], "via mcp");
    let listed: Vec<&Value> = out["list_workspaces"]["structured"]["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| &w["id"])
        .collect();
    assert!(listed.contains(&&made["structured"]["id"]), "{listed:?}");
    assert!(listed.contains(&&json!(workspace)), "{listed:?}");
    assert_eq!(listed.len(), 2, "only this team's workspaces: {listed:?}");
    assert_eq!(
        out["wait_written"]["structured"]["last_turn"]["outcome"],
        "completed"
    );
    let diff = &out["get_diff"]["structured"];
    assert_eq!(diff["files"][0]["path"], "notes.txt", "{diff}");
    assert!(diff["patch"].as_str().unwrap().contains("+hello"), "{diff}");
    assert_eq!(
        out["send_message"]["is_error"], false,
        "{}",
        out["send_message"]
    );
    assert!(
        out["send_message"]["structured"]["turn_id"]
            .as_str()
            .unwrap()
            .starts_with("trn_")
    );
    assert_eq!(out["interrupt_agent"]["is_error"], false);
    let stopped = &out["wait_interrupted"]["structured"];
    assert_eq!(stopped["last_turn"]["outcome"], "canceled", "{stopped}");
    assert_eq!(
        stopped["last_turn"]["turn_id"],
        out["send_message"]["structured"]["turn_id"]
    );
}

/// Each tool's input schema is its operation's parameters and request body as the
/// committed OpenAPI document describes them.
fn tool_schemas_agree_with_the_openapi_document(tools: &Value) {
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json"))
            .unwrap(),
    )
    .unwrap();
    for spec in agentry::api::mcp::TOOLS {
        let listed = tools
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == spec.name)
            .unwrap();
        let schema = &listed["inputSchema"];
        assert_eq!(
            schema,
            &agentry::api::mcp::input_schema(&doc, spec),
            "{}",
            spec.name
        );
        // And, read directly: every body property and every required one of the request
        // schema, every query parameter, every path parameter (under the tool's name).
        let op = &doc["paths"][spec.path][spec.method.to_lowercase()];
        assert!(
            op.is_object(),
            "{} {} is not in the document",
            spec.method,
            spec.path
        );
        if let Some(body) =
            op["requestBody"]["content"]["application/json"]["schema"]["$ref"].as_str()
        {
            let component = &doc["components"]["schemas"][body.rsplit('/').next().unwrap()];
            for (name, prop) in component["properties"].as_object().unwrap() {
                let tool_prop = &schema["properties"][name];
                assert!(tool_prop.is_object(), "{}: {name} missing", spec.name);
                if prop.get("$ref").is_none() {
                    assert_eq!(prop["type"], tool_prop["type"], "{}: {name}", spec.name);
                }
            }
            for name in component["required"].as_array().into_iter().flatten() {
                assert!(
                    schema["required"].as_array().unwrap().contains(name),
                    "{}: {name} should be required",
                    spec.name
                );
            }
        }
        for p in op["parameters"].as_array().into_iter().flatten() {
            let name = p["name"].as_str().unwrap();
            match p["in"].as_str().unwrap() {
                "query" => assert_eq!(
                    schema["properties"][name]["type"], p["schema"]["type"],
                    "{}: {name}",
                    spec.name
                ),
                "path" => {
                    let arg = spec
                        .path_args
                        .iter()
                        .find(|(param, _)| *param == name)
                        .unwrap()
                        .1;
                    assert_eq!(schema["properties"][arg]["type"], "string");
                    assert!(schema["required"].as_array().unwrap().contains(&json!(arg)));
                }
                _ => {}
            }
        }
    }
}

async fn rpc(
    app: &super::helpers::TestApp,
    token: Option<&str>,
    session: Option<&str>,
    body: Value,
) -> reqwest::Response {
    let mut req = app
        .client
        .post(app.url("/mcp"))
        .header("Accept", "application/json, text/event-stream")
        .json(&body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(s) = session {
        req = req.header("Mcp-Session-Id", s);
    }
    req.send().await.unwrap()
}

#[tokio::test]
async fn the_endpoint_wants_a_bearer_token_and_its_own_session() {
    let app = spawn_app().await;
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"}}});

    // No token: 401 like /v1, even with a (browser) session cookie.
    let res = rpc(&app, None, None, init.clone()).await;
    assert_eq!(res.status(), 401);
    assert!(res.headers().contains_key("www-authenticate"));
    assert_eq!(res.json::<Value>().await.unwrap()["code"], "token_missing");
    let res = app
        .client
        .post(app.url("/mcp"))
        .header("Cookie", "agentry_session=whatever")
        .json(&init)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 401);
    let res = rpc(&app, Some("agt_pat_not_a_real_one"), None, init.clone()).await;
    assert_eq!(res.status(), 401);

    // The server offers no stream of its own.
    let res = app
        .client
        .get(app.url("/mcp"))
        .bearer_auth(&app.token)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 405);

    let res = rpc(&app, Some(&app.token), None, init.clone()).await;
    assert_eq!(res.status(), 200);
    let session = res.headers()["mcp-session-id"].to_str().unwrap().to_owned();
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["result"]["protocolVersion"], "2025-06-18");
    assert_eq!(
        body["result"]["capabilities"]["tools"]["listChanged"],
        false
    );

    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    // Without the session, or with one this token did not open: refused.
    assert_eq!(
        rpc(&app, Some(&app.token), None, list.clone())
            .await
            .status(),
        400
    );
    let other = person(&app, "carol").await;
    assert_eq!(
        rpc(&app, Some(&other.api.token), Some(&session), list.clone())
            .await
            .status(),
        404
    );
    let res = rpc(&app, Some(&app.token), Some(&session), list.clone()).await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        res.json::<Value>().await.unwrap()["result"]["tools"]
            .as_array()
            .unwrap()
            .len(),
        agentry::api::mcp::TOOLS.len()
    );
    // A notification is accepted with no body; an unknown method is a JSON-RPC error.
    let res = rpc(
        &app,
        Some(&app.token),
        Some(&session),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    )
    .await;
    assert_eq!(res.status(), 202);
    let res = rpc(
        &app,
        Some(&app.token),
        Some(&session),
        json!({"jsonrpc": "2.0", "id": 3, "method": "resources/list"}),
    )
    .await;
    assert_eq!(res.json::<Value>().await.unwrap()["error"]["code"], -32601);

    // DELETE ends the session.
    let res = app
        .client
        .delete(app.url("/mcp"))
        .bearer_auth(&app.token)
        .header("Mcp-Session-Id", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 204);
    assert_eq!(
        rpc(&app, Some(&app.token), Some(&session), list)
            .await
            .status(),
        404
    );
}

#[tokio::test]
async fn a_read_only_token_lists_but_cannot_drive() {
    let app = spawn_app().await;
    let (alice, _, workspace, _repo) = member_with_workspace(&app, "dora").await;
    let read_only = alice
        .api
        .ok(
            Method::POST,
            "/v1/tokens",
            Some(json!({"name": "reader", "scopes": ["read"]})),
            201,
        )
        .await;
    let token = read_only["token"].as_str().unwrap();
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"}}});
    let res = rpc(&app, Some(token), None, init).await;
    let session = res.headers()["mcp-session-id"].to_str().unwrap().to_owned();
    let call = |name: &str, arguments: Value| {
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": name, "arguments": arguments}})
    };
    let listed: Value = rpc(
        &app,
        Some(token),
        Some(&session),
        call("list_workspaces", json!({})),
    )
    .await
    .json()
    .await
    .unwrap();
    let result = &listed["result"];
    assert_eq!(result["isError"], false, "{listed}");
    assert_eq!(
        result["structuredContent"]["items"][0]["id"],
        workspace.as_str()
    );

    let refused: Value = rpc(
        &app,
        Some(token),
        Some(&session),
        call(
            "create_agent",
            json!({"workspace_id": workspace, "provider": "mock"}),
        ),
    )
    .await
    .json()
    .await
    .unwrap();
    let result = &refused["result"];
    assert_eq!(result["isError"], true, "{refused}");
    assert_eq!(result["structuredContent"]["code"], "insufficient_scope");
    assert!(
        result["content"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("insufficient_scope:")
    );
}

/// One `tools/call` on an open session; its `result`.
async fn tool(app: &super::helpers::TestApp, session: &str, name: &str, arguments: Value) -> Value {
    let res = rpc(
        app,
        Some(&app.token),
        Some(session),
        json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": name, "arguments": arguments}}),
    )
    .await;
    assert_eq!(res.status(), 200);
    let body: Value = res.json().await.unwrap();
    body["result"].clone()
}

#[tokio::test]
async fn a_tool_call_for_an_agent_another_replica_runs_is_handed_to_that_replica() {
    let lease = |s: &mut agentry::config::Settings| s.cluster.lease_ttl_s = 3;
    let a = super::helpers::spawn_app_with(lease).await;
    let b = super::helpers::spawn_on_with(
        a.db.clone(),
        tempfile::tempdir().unwrap(),
        Some(a.token.clone()),
        lease,
    )
    .await;
    let repo = git_repo();
    let (agent, _) = a.mock_agent(repo.path()).await;
    a.wait(&agent).await;
    let owner = a.get_ok(&format!("/v1/agents/{agent}")).await["runtime"]["replica"].clone();
    assert!(owner.is_string(), "{owner}");

    // The client talks to the replica that does not run the agent.
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"}}});
    let res = rpc(&b, Some(&b.token), None, init).await;
    let session = res.headers()["mcp-session-id"].to_str().unwrap().to_owned();

    let sent = tool(
        &b,
        &session,
        "send_message",
        json!({"agent_id": agent, "text": "/ask ship?"}),
    )
    .await;
    assert_eq!(sent["isError"], false, "{sent}");
    let turn = sent["structuredContent"]["turn_id"].clone();
    let asking = tool(
        &b,
        &session,
        "wait_for_agent",
        json!({"agent_id": agent, "timeout_s": 30}),
    )
    .await;
    let asking = &asking["structuredContent"];
    assert_eq!(asking["status"], "waiting_permission", "{asking}");
    let request = asking["pending_permissions"][0]["request_id"]
        .as_str()
        .unwrap();
    let answered = tool(
        &b,
        &session,
        "answer_permission",
        json!({"agent_id": agent, "request_id": request, "behavior": "allow"}),
    )
    .await;
    assert_eq!(answered["isError"], false, "{answered}");
    let done = tool(
        &b,
        &session,
        "wait_for_agent",
        json!({"agent_id": agent, "timeout_s": 30}),
    )
    .await;
    let done = &done["structuredContent"];
    assert_eq!(done["last_turn"]["turn_id"], turn, "{done}");
    assert_eq!(done["last_turn"]["outcome"], "completed", "{done}");
    assert!(
        done["last_assistant_message"]
            .as_str()
            .unwrap()
            .contains("allow"),
        "{done}"
    );
    // It ran where it was: the owner did not change.
    assert_eq!(
        a.get_ok(&format!("/v1/agents/{agent}")).await["runtime"]["replica"],
        owner
    );
    // A problem the owner answers reaches the client with its code.
    let again = tool(
        &b,
        &session,
        "answer_permission",
        json!({"agent_id": agent, "request_id": request, "behavior": "deny"}),
    )
    .await;
    assert_eq!(again["isError"], true, "{again}");
    assert_eq!(
        again["structuredContent"]["code"],
        "permission_already_resolved"
    );

    let archived = tool(&b, &session, "archive_agent", json!({"agent_id": agent})).await;
    assert_eq!(archived["isError"], false, "{archived}");
    assert!(!a.get_ok(&format!("/v1/agents/{agent}")).await["archived_at"].is_null());
}
