//! Budgets that hold mid-turn: a team's monthly budget, an agent's and a workspace's caps
//! interrupt the turn that crosses them, refuse new prompts and agents with 429
//! `budget_exhausted`, and tell the team's hooks at 80 % and 100 %.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use crate::helpers::*;
use crate::usage::default_team;

use crate::hooks::http;

async fn put_budget(app: &TestApp, team: &str, body: Value) -> reqwest::Response {
    app.client
        .put(app.url(&format!("/v1/teams/{team}/budget")))
        .bearer_auth(&app.token)
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// The usage events and the end of the agent's last turn.
async fn last_turn(app: &TestApp, agent: &str) -> (Vec<Value>, Value) {
    let timeline = app.timeline(agent).await;
    let end = timeline
        .iter()
        .rfind(|e| e["kind"] == "turn_completed")
        .cloned()
        .unwrap_or_else(|| panic!("a turn_completed in {timeline:?}"));
    let usage = timeline
        .iter()
        .filter(|e| e["kind"] == "usage" && e["turn_id"] == end["turn_id"])
        .cloned()
        .collect();
    (usage, end)
}

#[tokio::test]
async fn a_budget_crossed_mid_turn_interrupts_the_turn_and_refuses_new_work() {
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let agent = app.agent_in_new_workspace(&project, "mock").await;
    let team = default_team(&app).await;
    let set = expect_status(
        put_budget(
            &app,
            &team,
            json!({"period": "month", "max_cost_usd": 0.01}),
        )
        .await,
        200,
    )
    .await;
    assert_eq!(set["max_cost_usd"], 0.01, "{set}");

    // Each call of this turn costs 0.018 USD; it would make five, 30 s apart. The first
    // one crosses the budget: the turn is interrupted there.
    app.prompt(&agent, "/spend 1000 1000 5 30000").await;
    let done = app.wait(&agent).await;
    assert_eq!(done["status"], "idle", "{done}");
    let (usage, end) = last_turn(&app, &agent).await;
    assert_eq!(end["data"]["outcome"], "canceled", "{end}");
    assert_eq!(end["data"]["error_code"], "budget_exhausted", "{end}");
    let error = end["data"]["error"].as_str().unwrap();
    assert!(error.contains("team.cost_usd"), "{error}");
    assert_eq!(
        usage.len(),
        1,
        "the turn stopped at the first usage event: {usage:?}"
    );
    let timeline = app.timeline(&agent).await;
    let said = timeline
        .iter()
        .find(|e| e["kind"] == "error" && e["data"]["code"] == "budget_exhausted")
        .unwrap_or_else(|| panic!("a budget_exhausted error event: {timeline:?}"));
    assert_eq!(said["data"]["budget"]["budget"], "team.cost_usd");

    // The ledger holds the interrupted turn's spend.
    let budget = app.get_ok(&format!("/v1/teams/{team}/budget")).await;
    assert!(
        (budget["used_cost_usd"].as_f64().unwrap() - 0.018).abs() < 1e-9,
        "{budget}"
    );

    // New prompts and agents: 429 with the budget, its period and when it resets.
    let res = app
        .post(
            &format!("/v1/agents/{agent}/messages"),
            json!({"text": "more"}),
        )
        .await;
    let retry_after: i64 = res
        .headers()
        .get("retry-after")
        .expect("Retry-After")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let refused = expect_status(res, 429).await;
    assert_eq!(refused["code"], "budget_exhausted", "{refused}");
    assert_eq!(refused["budget"]["budget"], "team.cost_usd", "{refused}");
    assert_eq!(refused["budget"]["period"], "month", "{refused}");
    assert_eq!(
        refused["budget"]["resets_at"], budget["resets_at"],
        "{refused}"
    );
    let resets: chrono::DateTime<chrono::Utc> =
        budget["resets_at"].as_str().unwrap().parse().unwrap();
    let left = (resets - chrono::Utc::now()).num_seconds();
    assert!((retry_after - left).abs() <= 5, "{retry_after} vs {left}");
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let refused = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock"}),
            429,
        )
        .await;
    assert_eq!(refused["code"], "budget_exhausted", "{refused}");
    // Both refusals are in the contract.
    let doc = app.get_ok("/openapi.json").await;
    for (path, method) in [("/v1/agents", "post"), ("/v1/agents/{id}/messages", "post")] {
        assert!(
            doc["paths"][path][method]["responses"]["429"].is_object(),
            "{method} {path} documents 429"
        );
    }

    // Raising the budget lets work start again.
    expect_status(
        put_budget(&app, &team, json!({"period": "month", "max_cost_usd": 1.0})).await,
        200,
    )
    .await;
    app.prompt(&agent, "hello").await;
    assert_eq!(app.wait(&agent).await["last_turn"]["outcome"], "completed");
}

#[tokio::test]
async fn an_agents_caps_stop_its_turns_and_its_wall_time() {
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let unknown = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "budget": {"max_tokens": 5}}),
            422,
        )
        .await;
    assert_eq!(unknown["code"], "validation_failed", "{unknown}");

    let agent = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock",
                "budget": {"max_turns": 2, "max_wall_time_s": 1}}),
            201,
        )
        .await;
    let agent = agent["id"].as_str().unwrap().to_owned();
    app.wait(&agent).await;
    app.prompt(&agent, "hello").await;
    assert_eq!(app.wait(&agent).await["last_turn"]["outcome"], "completed");
    // A turn that would sleep 30 s is stopped when the agent's second of wall time is up.
    app.prompt(&agent, "/sleep 30000").await;
    app.wait(&agent).await;
    let (_, end) = last_turn(&app, &agent).await;
    assert_eq!(end["data"]["outcome"], "canceled", "{end}");
    assert_eq!(end["data"]["error_code"], "budget_exhausted", "{end}");
    assert!(
        end["data"]["error"]
            .as_str()
            .unwrap()
            .contains("agent.wall_time_s"),
        "{end}"
    );
    // Two turns used: the third is refused, naming the cap; an agent's caps do not reset.
    let refused = app
        .post_ok(
            &format!("/v1/agents/{agent}/messages"),
            json!({"text": "again"}),
            429,
        )
        .await;
    assert_eq!(refused["code"], "budget_exhausted", "{refused}");
    assert_eq!(refused["budget"]["budget"], "agent.turns", "{refused}");
    assert_eq!(refused["budget"]["period"], "agent", "{refused}");
    assert!(refused["budget"].get("resets_at").is_none(), "{refused}");
}

#[tokio::test]
async fn owners_set_their_budget_within_the_admins_limit_and_admins_any() {
    let app = spawn_app_with(|s| s.usage.max_team_cost_usd = Some(100.0)).await;
    let ana = crate::people::person(&app, "ana").await;
    let bo = crate::people::person(&app, "bo").await;
    let team = crate::people::team(&ana, "ana-team").await;
    crate::people::add(&ana, &team, &bo, "member").await;
    let path = format!("/v1/teams/{team}/budget");
    ana.api
        .refused(
            Method::PUT,
            &path,
            Some(json!({"period": "month", "max_cost_usd": 150.0})),
            422,
            "validation_failed",
        )
        .await;
    ana.api
        .refused(
            Method::PUT,
            &path,
            Some(json!({"period": "month"})),
            422,
            "validation_failed",
        )
        .await;
    ana.api
        .refused(
            Method::PUT,
            &path,
            Some(json!({"period": "week", "max_cost_usd": 10.0})),
            422,
            "validation_failed",
        )
        .await;
    let set = ana
        .api
        .ok(
            Method::PUT,
            &path,
            Some(json!({"period": "month", "max_cost_usd": 50.0, "max_tokens": 1000000})),
            200,
        )
        .await;
    assert_eq!(set["max_cost_usd"], 50.0, "{set}");
    assert_eq!(set["limits"]["max_cost_usd"], 100.0, "{set}");
    // A member reads it and cannot change it.
    let read = bo.api.ok(Method::GET, &path, None, 200).await;
    assert_eq!(read["max_tokens"], 1000000, "{read}");
    bo.api
        .refused(
            Method::PUT,
            &path,
            Some(json!({"period": "month", "max_cost_usd": 1.0})),
            403,
            "forbidden",
        )
        .await;
    // The admin may go past the owners' limit.
    let admin = expect_status(
        put_budget(
            &app,
            &team,
            json!({"period": "month", "max_cost_usd": 150.0}),
        )
        .await,
        200,
    )
    .await;
    assert_eq!(admin["max_cost_usd"], 150.0, "{admin}");
}

/// A webhook receiver that records the `Agentry-Event` and body of every request (the
/// hooks suite checks signatures; here only what arrives counts).
struct Receiver {
    addr: SocketAddr,
    got: Arc<Mutex<Vec<(String, Value)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Receiver {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let g = g.clone();
                tokio::spawn(async move {
                    let Some((head, body)) = http::read_request(&mut stream).await else {
                        return;
                    };
                    let event = head
                        .lines()
                        .find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.trim()
                                .eq_ignore_ascii_case("agentry-event")
                                .then(|| v.trim().to_owned())
                        })
                        .unwrap_or_default();
                    let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    g.lock().unwrap().push((event, body));
                    let _ = stream
                        .write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
                        .await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Self { addr, got, task }
    }

    fn of(&self, event: &str) -> Vec<Value> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .filter(|(e, _)| e == event)
            .map(|(_, b)| b.clone())
            .collect()
    }
}

/// The deliveries of `hook` for `budget.threshold`, once all are delivered.
async fn delivered(app: &TestApp, hook: &str, n: usize) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let list = app.get_ok(&format!("/v1/hooks/{hook}/deliveries")).await;
        let items: Vec<Value> = list["items"].as_array().unwrap().clone();
        if items.len() >= n && items.iter().all(|d| d["status"] == "delivered") {
            return items;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} deliveries delivered: {list}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_teams_hooks_hear_of_80_and_100_percent_once_each() {
    let app = spawn_app_with(|s| {
        s.hooks.allow_private_networks = true;
        s.hooks.timeout_s = 2;
    })
    .await;
    let receiver = Receiver::start().await;
    let hook = app
        .post_ok(
            "/v1/hooks",
            json!({"name": "spend-watch", "events": ["budget.threshold"],
                "url": format!("http://{}/budget", receiver.addr), "secret": "whsec_test_0123456789"}),
            201,
        )
        .await;
    let hook = hook["id"].as_str().unwrap().to_owned();
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let agent = app.agent_in_new_workspace(&project, "mock").await;
    let team = default_team(&app).await;
    expect_status(
        put_budget(
            &app,
            &team,
            json!({"period": "month", "max_cost_usd": 0.05}),
        )
        .await,
        200,
    )
    .await;

    // 0.045 USD: 90 %, past 80 %.
    app.prompt(&agent, "/usage 10000 1000").await;
    app.wait(&agent).await;
    let first = delivered(&app, &hook, 1).await;
    assert_eq!(first.len(), 1, "{first:?}");
    // 0.0495 USD: 99 %, still one notice.
    app.prompt(&agent, "/usage 1000 100").await;
    app.wait(&agent).await;
    // 0.054 USD: past 100 %.
    app.prompt(&agent, "/usage 1000 100").await;
    app.wait(&agent).await;
    let all = delivered(&app, &hook, 2).await;
    assert_eq!(all.len(), 2, "one notice at 80 %, one at 100 %: {all:?}");

    let bodies = receiver.of("budget.threshold");
    let mut percents: Vec<i64> = bodies
        .iter()
        .map(|b| b["payload"]["percent"].as_i64().unwrap())
        .collect();
    percents.sort();
    assert_eq!(percents, [80, 100], "{bodies:?}");
    for b in &bodies {
        assert_eq!(b["hook"], "budget.threshold", "{b}");
        assert_eq!(b["team_id"], team.as_str(), "{b}");
        assert_eq!(b["payload"]["budget"], "team.cost_usd", "{b}");
        assert_eq!(b["payload"]["period"], "month", "{b}");
    }
}

#[tokio::test]
async fn a_token_budget_counts_input_and_output_and_refuses_the_next_prompt() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, _) = app.mock_agent(repo.path()).await;
    app.wait(&agent).await;
    let team = default_team(&app).await;
    expect_status(
        put_budget(&app, &team, json!({"period": "month", "max_tokens": 1000})).await,
        200,
    )
    .await;
    // 900 tokens: under the budget.
    app.prompt(&agent, "/tokens 800 100").await;
    assert_eq!(app.wait(&agent).await["last_turn"]["outcome"], "completed");
    app.prompt(&agent, "/tokens 100 50").await;
    assert_eq!(app.wait(&agent).await["last_turn"]["outcome"], "completed");
    let budget = app.get_ok(&format!("/v1/teams/{team}/budget")).await;
    assert_eq!(budget["used_tokens"], 1050, "{budget}");
    let refused = app
        .post_ok(
            &format!("/v1/agents/{agent}/messages"),
            json!({"text": "more"}),
            429,
        )
        .await;
    assert_eq!(refused["budget"]["budget"], "team.tokens", "{refused}");
    assert_eq!(refused["budget"]["limit"], 1000.0, "{refused}");
    assert_eq!(refused["budget"]["used"], 1050.0, "{refused}");
}

#[tokio::test]
async fn a_workspaces_caps_hold_over_all_its_agents_and_only_owners_set_them() {
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let ws = ws["id"].as_str().unwrap().to_owned();
    let path = format!("/v1/workspaces/{ws}/budget");
    let put = |body: Value| {
        app.client
            .put(app.url(&path))
            .bearer_auth(&app.token)
            .json(&body)
            .send()
    };
    let unknown = expect_status(put(json!({"max_tokens": 5})).await.unwrap(), 422).await;
    assert_eq!(unknown["code"], "validation_failed", "{unknown}");
    let negative = expect_status(put(json!({"max_cost_usd": -1})).await.unwrap(), 422).await;
    assert_eq!(negative["errors"][0]["field"], "max_cost_usd", "{negative}");
    let set = expect_status(
        put(json!({"max_cost_usd": 0.02, "max_turns": 3}))
            .await
            .unwrap(),
        200,
    )
    .await;
    assert_eq!(set["max_cost_usd"], 0.02, "{set}");
    assert_eq!(set["max_turns"], 3, "{set}");
    assert_eq!(set["used_turns"], 0, "{set}");

    // Two agents share the workspace's caps: the first spends 0.018 USD in one call.
    let first = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws, "provider": "mock"}),
            201,
        )
        .await;
    let first = first["id"].as_str().unwrap().to_owned();
    app.wait(&first).await;
    app.prompt(&first, "/spend 1000 1000 1 0").await;
    assert_eq!(app.wait(&first).await["last_turn"]["outcome"], "completed");
    // The second's turn would make five such calls, 30 s apart: the first crosses the
    // workspace's cost cap and the turn is interrupted there.
    let second = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws, "provider": "mock"}),
            201,
        )
        .await;
    let second = second["id"].as_str().unwrap().to_owned();
    app.wait(&second).await;
    app.prompt(&second, "/spend 1000 1000 5 30000").await;
    app.wait(&second).await;
    let (usage, end) = last_turn(&app, &second).await;
    assert_eq!(end["data"]["outcome"], "canceled", "{end}");
    assert_eq!(end["data"]["error_code"], "budget_exhausted", "{end}");
    let error = end["data"]["error"].as_str().unwrap();
    assert!(error.contains("workspace.cost_usd"), "{error}");
    assert_eq!(
        usage.len(),
        1,
        "stopped at the first usage event: {usage:?}"
    );
    let used = app.get_ok(&path).await;
    assert_eq!(used["used_turns"], 2, "{used}");
    assert!(
        (used["used_cost_usd"].as_f64().unwrap() - 0.036).abs() < 1e-9,
        "{used}"
    );

    // New prompts and new agents in the workspace: 429 naming the cap, which never resets.
    let refused = app
        .post_ok(
            &format!("/v1/agents/{first}/messages"),
            json!({"text": "again"}),
            429,
        )
        .await;
    assert_eq!(refused["code"], "budget_exhausted", "{refused}");
    assert_eq!(
        refused["budget"]["budget"], "workspace.cost_usd",
        "{refused}"
    );
    assert_eq!(refused["budget"]["period"], "workspace", "{refused}");
    assert!(refused["budget"].get("resets_at").is_none(), "{refused}");
    let refused = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws, "provider": "mock"}),
            429,
        )
        .await;
    assert_eq!(
        refused["budget"]["budget"], "workspace.cost_usd",
        "{refused}"
    );

    // Lifting the cost cap leaves the turn cap: two turns used, one more may run.
    expect_status(put(json!({"max_turns": 3})).await.unwrap(), 200).await;
    app.prompt(&first, "hello").await;
    assert_eq!(app.wait(&first).await["last_turn"]["outcome"], "completed");
    let refused = app
        .post_ok(
            &format!("/v1/agents/{second}/messages"),
            json!({"text": "once more"}),
            429,
        )
        .await;
    assert_eq!(refused["budget"]["budget"], "workspace.turns", "{refused}");
    assert_eq!(refused["budget"]["limit"], 3.0, "{refused}");

    // A member reads the caps but may not set them; someone of no team does not see them.
    let team = default_team(&app).await;
    let bo = crate::people::person(&app, "bo").await;
    let carl = crate::people::person(&app, "carl").await;
    let added = app
        .client
        .put(app.url(&format!("/v1/teams/{team}/members/{}", bo.id)))
        .bearer_auth(&app.token)
        .json(&json!({"role": "member"}))
        .send()
        .await
        .unwrap();
    expect_status(added, 201).await;
    let read = bo.api.ok(Method::GET, &path, None, 200).await;
    assert_eq!(read["max_turns"], 3, "{read}");
    bo.api
        .refused(Method::PUT, &path, Some(json!({})), 403, "forbidden")
        .await;
    carl.api
        .refused(Method::GET, &path, None, 404, "not_found")
        .await;
}

#[tokio::test]
async fn with_the_ledger_off_no_turn_is_recorded_and_no_budget_can_be_set() {
    let app = spawn_app_with(|s| s.usage.ledger = false).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let team = default_team(&app).await;
    let refused = expect_status(
        put_budget(&app, &team, json!({"period": "month", "max_cost_usd": 1.0})).await,
        422,
    )
    .await;
    assert!(
        refused["detail"].as_str().unwrap().contains("usage.ledger"),
        "{refused}"
    );
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let refused = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "budget": {"max_turns": 1}}),
            422,
        )
        .await;
    assert_eq!(refused["errors"][0]["field"], "budget", "{refused}");
    let caps = app
        .client
        .put(app.url(&format!(
            "/v1/workspaces/{}/budget",
            ws["id"].as_str().unwrap()
        )))
        .bearer_auth(&app.token)
        .json(&json!({"max_turns": 1}))
        .send()
        .await
        .unwrap();
    expect_status(caps, 422).await;
    // A turn that reports a cost runs and is in its timeline, not in the ledger.
    let agent = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock"}),
            201,
        )
        .await;
    let agent = agent["id"].as_str().unwrap().to_owned();
    app.wait(&agent).await;
    app.prompt(&agent, "/spend 1000 1000 1 0").await;
    assert_eq!(app.wait(&agent).await["last_turn"]["outcome"], "completed");
    let (usage, _) = last_turn(&app, &agent).await;
    assert_eq!(usage.len(), 1, "{usage:?}");
    let report = app.get_ok("/v1/usage").await;
    assert_eq!(report["totals"]["turns"], 0, "{report}");
}
