//! Prompts that wait: follow-ups sent to a busy agent run in order after its turn (and can
//! be canceled, or steer the turn), and prompts over the running-turn limits wait in a
//! queue that is fair between teams and survives a restart.

use std::time::Duration;

use serde_json::{Value, json};

use crate::helpers::*;

/// Read the agent's events until `n` turns completed; every event read.
async fn until_turns(app: &TestApp, agent: &str, n: usize) -> Vec<SseEvent> {
    until_counts(app, agent, &[("turn_completed", n)]).await
}

/// The agent's timeline from the start until it holds at least as many events of each
/// kind as `want` says.
async fn until_counts(app: &TestApp, agent: &str, want: &[(&str, usize)]) -> Vec<SseEvent> {
    let mut sse = app.events(agent, None).await;
    let mut seen: Vec<SseEvent> = Vec::new();
    let short = |seen: &[SseEvent]| {
        want.iter()
            .any(|(kind, n)| seen.iter().filter(|e| e.event == *kind).count() < *n)
    };
    while short(&seen) {
        let ev = sse
            .next(Duration::from_secs(60))
            .await
            .unwrap_or_else(|| panic!("{want:?} of {agent}; saw {:?}", kinds(&seen)));
        seen.push(ev);
    }
    seen
}

fn user_texts(events: &[SseEvent]) -> Vec<String> {
    of_kind(events, "user_message")
        .iter()
        .map(|e| e["text"].as_str().unwrap().to_owned())
        .collect()
}

async fn send(app: &TestApp, agent: &str, body: Value) -> Value {
    app.post_ok(&format!("/v1/agents/{agent}/messages"), body, 202)
        .await
}

#[tokio::test]
async fn follow_ups_wait_for_the_turn_run_in_order_and_cancel_cleanly() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    app.prompt(&id, "/ask hold on?").await;
    let w = app.wait(&id).await;
    assert_eq!(w["status"], "waiting_permission");
    let request = w["pending_permissions"][0]["request_id"]
        .as_str()
        .unwrap()
        .to_owned();

    // A client that wants the old refusal still gets it.
    let refused = app
        .post(
            &format!("/v1/agents/{id}/messages"),
            json!({"text": "not now", "queue": false}),
        )
        .await;
    assert_eq!(expect_status(refused, 409).await["code"], "agent_busy");

    let mut ids = Vec::new();
    for (n, text) in ["first follow-up", "second follow-up", "third follow-up"]
        .into_iter()
        .enumerate()
    {
        let q = send(
            &app,
            &id,
            json!({"text": text, "client_message_id": format!("c{n}")}),
        )
        .await;
        assert_eq!(q["queued"], true, "{q}");
        assert_eq!(q["position"], n as i64 + 1, "{q}");
        assert_eq!(q["reason"], "agent_busy", "{q}");
        assert!(q.get("turn_id").is_none(), "{q}");
        ids.push(q["message_id"].as_str().unwrap().to_owned());
    }
    let listed = app
        .get_ok(&format!("/v1/agents/{id}/messages?state=queued"))
        .await;
    let listed_ids: Vec<&str> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed_ids, ids, "{listed}");
    assert_eq!(listed["items"][2]["position"], 3);
    let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(agent["queue"]["messages"], 3, "{agent}");
    assert_eq!(agent["queue"]["waiting_for"], "agent_busy", "{agent}");
    assert_eq!(agent["status"], "waiting_permission", "{agent}");

    // The second is canceled; canceling it again is refused.
    let path = format!("/v1/agents/{id}/messages/{}", ids[1]);
    assert_eq!(app.delete(&path).await.status(), 204);
    let again = app.delete(&path).await;
    assert_eq!(
        expect_status(again, 409).await["code"],
        "message_not_queued"
    );
    let unknown = app
        .delete(&format!(
            "/v1/agents/{id}/messages/msg_0193a1b2c3d47e8f9a0b1c2d3e4f5a6b"
        ))
        .await;
    assert_eq!(expect_status(unknown, 404).await["code"], "not_found");

    // The turn ends; the first and the third run after it, in order.
    app.post_ok(
        &format!("/v1/agents/{id}/permissions/{request}"),
        json!({"behavior": "allow"}),
        200,
    )
    .await;
    // A message's `message_dequeued` names the turn it started, so it is written once
    // that turn has started: a short turn can end before it.
    let events = until_counts(&app, &id, &[("turn_completed", 3), ("message_dequeued", 3)]).await;
    assert_eq!(
        user_texts(&events),
        ["/ask hold on?", "first follow-up", "third follow-up"]
    );
    let outcomes: Vec<&Value> = of_kind(&events, "turn_completed")
        .iter()
        .map(|e| &e["outcome"])
        .collect();
    assert!(outcomes.iter().all(|o| *o == "completed"), "{outcomes:?}");
    let started: Vec<&Value> = of_kind(&events, "turn_started")
        .iter()
        .map(|e| &e["turn_id"])
        .collect();
    let dequeued = of_kind(&events, "message_dequeued");
    let queued = of_kind(&events, "message_queued");
    assert_eq!(queued.len(), 3, "every queued message is on the timeline");
    assert_eq!(dequeued.len(), 3, "{dequeued:?}");
    assert_eq!(dequeued[0]["state"], "canceled");
    assert_eq!(dequeued[0]["message_id"], ids[1].as_str());
    assert_eq!(dequeued[1]["message_id"], ids[0].as_str());
    assert_eq!(dequeued[1]["turn_id"], *started[1]);
    assert_eq!(dequeued[2]["message_id"], ids[2].as_str());
    assert_eq!(dequeued[2]["turn_id"], *started[2]);
    let cmids: Vec<&Value> = of_kind(&events, "user_message")
        .iter()
        .map(|e| &e["client_message_id"])
        .collect();
    assert_eq!(cmids[1], "c0");
    assert_eq!(cmids[2], "c2");

    let all = app.get_ok(&format!("/v1/agents/{id}/messages")).await;
    let states: Vec<(&str, &str)> = all["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["state"].as_str().unwrap()))
        .collect();
    assert_eq!(
        states,
        [
            (ids[0].as_str(), "started"),
            (ids[1].as_str(), "canceled"),
            (ids[2].as_str(), "started")
        ]
    );
    assert_eq!(all["items"][0]["turn_id"], *started[1]);
    let none = app
        .get_ok(&format!("/v1/agents/{id}/messages?state=queued"))
        .await;
    assert_eq!(none["items"], json!([]));
    let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
    assert!(agent.get("queue").is_none(), "{agent}");
    let bad = app
        .get(&format!("/v1/agents/{id}/messages?state=nope"))
        .await;
    assert_eq!(expect_status(bad, 400).await["code"], "invalid_query");
}

#[tokio::test]
async fn a_steering_message_interrupts_the_turn_and_runs_before_the_queue() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    app.prompt(&id, "/ask long job?").await;
    assert_eq!(app.wait(&id).await["status"], "waiting_permission");
    let later = send(&app, &id, json!({"text": "after that"})).await;
    assert_eq!(later["position"], 1);
    let steer = send(
        &app,
        &id,
        json!({"text": "stop, do this", "interrupt": true}),
    )
    .await;
    assert_eq!(steer["queued"], true, "{steer}");
    assert_eq!(
        steer["position"], 1,
        "a steering message goes first: {steer}"
    );
    let events = until_turns(&app, &id, 3).await;
    let outcomes: Vec<&Value> = of_kind(&events, "turn_completed")
        .iter()
        .map(|e| &e["outcome"])
        .collect();
    assert_eq!(outcomes, ["canceled", "completed", "completed"]);
    assert_eq!(
        user_texts(&events),
        ["/ask long job?", "stop, do this", "after that"]
    );
    let refused = app
        .post(
            &format!("/v1/agents/{id}/messages"),
            json!({"text": "x", "interrupt": true, "queue": false}),
        )
        .await;
    assert_eq!(
        expect_status(refused, 422).await["code"],
        "validation_failed"
    );
}

/// `n` idle mock agents of a new team (its own project and repository).
async fn team_agents(
    app: &TestApp,
    name: &str,
    n: usize,
) -> (String, Vec<String>, tempfile::TempDir) {
    let team = app.post_ok("/v1/teams", json!({"name": name}), 201).await;
    let team_id = team["id"].as_str().unwrap().to_owned();
    let repo = git_repo();
    let project = app
        .post_ok(
            "/v1/projects",
            json!({"name": name, "team_id": team_id, "repo_path": repo.path()}),
            201,
        )
        .await;
    let mut agents = Vec::new();
    for _ in 0..n {
        agents.push(app.agent_in_new_workspace(&project, "mock").await);
    }
    (team_id, agents, repo)
}

/// When the agent's (single) turn started.
async fn started_at(app: &TestApp, agent: &str) -> chrono::DateTime<chrono::Utc> {
    let events = until_turns(app, agent, 1).await;
    let started = events.iter().find(|e| e.event == "turn_started").unwrap();
    time(&started.data["at"])
}

fn time(v: &Value) -> chrono::DateTime<chrono::Utc> {
    v.as_str().unwrap().parse().unwrap()
}

#[tokio::test]
async fn thirty_prompts_of_three_teams_run_in_fair_order_at_a_limit_of_two_across_a_restart() {
    let limit = |s: &mut agentry::config::Settings| s.limits.max_running_turns = 2;
    let app = spawn_app_with(limit).await;
    let (red, mut reds, _r) = team_agents(&app, "red", 12).await;
    let (green, greens, _g) = team_agents(&app, "green", 10).await;
    let (blue, blues, _b) = team_agents(&app, "blue", 10).await;
    // Two turns of red hold both slots.
    let blockers: Vec<String> = reds.drain(..2).collect();
    for b in &blockers {
        let started = send(&app, b, json!({"text": "/ask hold?"})).await;
        assert_eq!(started["queued"], false, "{started}");
        assert!(started["turn_id"].is_string(), "{started}");
        assert_eq!(app.wait(b).await["status"], "waiting_permission");
    }
    // The team stream of the admin (who sees every team) hears each agent become queued.
    let team_stream = app
        .client
        .get(app.url("/v1/events"))
        .bearer_auth(&app.token)
        .send()
        .await
        .unwrap();
    assert_eq!(team_stream.status(), 200);
    let mut team_stream = SseReader::from_response(team_stream);
    // Ten prompts of each team, red's first: they all wait.
    for agent in reds.iter().chain(&greens).chain(&blues) {
        let q = send(&app, agent, json!({"text": "hello"})).await;
        assert_eq!(q["queued"], true, "{q}");
        assert_eq!(q["reason"], "capacity", "{q}");
    }
    // Round-robin: green and blue were never served, red twice.
    let mut fair = Vec::new();
    for i in 0..10 {
        fair.push((green.clone(), greens[i].clone()));
        fair.push((blue.clone(), blues[i].clone()));
        fair.push((red.clone(), reds[i].clone()));
    }
    let queue = app.get_ok("/v1/queue").await;
    assert_eq!(queue["running"], 2, "{queue}");
    assert_eq!(queue["max_running_turns"], 2, "{queue}");
    let items = queue["items"].as_array().unwrap();
    let listed: Vec<(String, String)> = items
        .iter()
        .map(|i| {
            assert_eq!(i["waiting_for"], "capacity", "{i}");
            (
                i["team_id"].as_str().unwrap().to_owned(),
                i["agent_id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(listed, fair);
    assert_eq!(items[4]["position"], 5);
    let red_first = app.get_ok(&format!("/v1/agents/{}", reds[0])).await;
    assert_eq!(red_first["status"], "queued", "{red_first}");
    assert_eq!(red_first["queue"]["position"], 3, "{red_first}");
    // Lists show the queued agents with their places, and filter on `queued`.
    let listed = app.get_ok("/v1/agents?status=queued&limit=200").await;
    let mut places: Vec<(i64, String)> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            assert_eq!(a["status"], "queued", "{a}");
            assert_eq!(a["queue"]["waiting_for"], "capacity", "{a}");
            (
                a["queue"]["position"].as_i64().unwrap(),
                a["id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    places.sort();
    let in_order: Vec<(i64, String)> = fair
        .iter()
        .enumerate()
        .map(|(i, (_, a))| (i as i64 + 1, a.clone()))
        .collect();
    assert_eq!(places, in_order, "the queued agents, by their places");
    let idle = app.get_ok("/v1/agents?status=idle&limit=200").await;
    let idle: Vec<&str> = idle["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap())
        .collect();
    assert!(
        fair.iter().all(|(_, a)| !idle.contains(&a.as_str())),
        "a queued agent is not listed as idle: {idle:?}"
    );
    let all = app.get_ok("/v1/agents?limit=200").await;
    let red_listed = all["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == reds[0].as_str())
        .unwrap()
        .clone();
    assert_eq!(red_listed["status"], "queued", "{red_listed}");
    assert_eq!(red_listed["queue"]["position"], 3, "{red_listed}");
    let mut heard = std::collections::HashMap::new();
    while heard.len() < fair.len() {
        let ev = team_stream
            .next(Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("agent_status queued for every agent; heard {heard:?}"));
        let data = &ev.data["data"];
        if ev.event == "agent_status" && data["status"] == "queued" {
            heard.insert(
                data["agent_id"].as_str().unwrap().to_owned(),
                data["position"].as_i64().unwrap(),
            );
        }
    }
    assert_eq!(heard[&blues[0]], 2, "{heard:?}");
    drop(team_stream);
    // Over the limit, a client that does not want to wait is refused.
    let refused = app
        .post(
            &format!("/v1/agents/{}/messages", reds[0]),
            json!({"text": "now", "queue": false}),
        )
        .await;
    let refused = expect_status(refused, 429).await;
    assert_eq!(refused["code"], "limit_reached");
    assert!(
        refused["detail"]
            .as_str()
            .unwrap()
            .contains("limits.max_running_turns"),
        "{refused}"
    );

    // The server restarts: the blocking turns end with it, the queue stays.
    let (db, dir, token) = app.stop().await;
    let app = spawn_on_with(db, dir, Some(token), limit).await;
    let mut starts = Vec::new();
    for (_, agent) in &fair {
        starts.push((started_at(&app, agent).await, agent.clone()));
    }
    starts.sort();
    let order: Vec<String> = starts.into_iter().map(|(_, a)| a).collect();
    let expected: Vec<String> = fair.iter().map(|(_, a)| a.clone()).collect();
    assert_eq!(order, expected, "the turns started in the fair order");
    // Never more than two at once.
    let mut spans = Vec::new();
    for (_, agent) in &fair {
        let tl = app.timeline(agent).await;
        let at = |k: &str| {
            tl.iter()
                .find(|e| e["kind"] == k)
                .map(|e| time(&e["at"]))
                .unwrap()
        };
        spans.push((at("turn_started"), at("turn_completed")));
    }
    for (start, _) in &spans {
        let running = spans
            .iter()
            .filter(|(s, e)| s <= start && start < e)
            .count();
        assert!(running <= 2, "{running} turns ran at {start}");
    }
    let queue = app.get_ok("/v1/queue").await;
    assert_eq!(queue["items"], json!([]), "{queue}");
}

#[tokio::test]
async fn a_replica_queues_and_cancels_for_an_agent_another_replica_runs() {
    let tweak = |s: &mut agentry::config::Settings| s.cluster.lease_ttl_s = 3;
    let a = spawn_app_with(tweak).await;
    let b = spawn_on_with(
        a.db.clone(),
        tempfile::tempdir().unwrap(),
        Some(a.token.clone()),
        tweak,
    )
    .await;
    let repo = git_repo();
    let (id, _) = a.mock_agent(repo.path()).await;
    a.wait(&id).await;
    let owner = a.get_ok(&format!("/v1/agents/{id}")).await["runtime"]["replica"].clone();
    a.prompt(&id, "/ask hold on?").await;
    assert_eq!(a.wait(&id).await["status"], "waiting_permission");
    let request = a.wait(&id).await["pending_permissions"][0]["request_id"]
        .as_str()
        .unwrap()
        .to_owned();

    // Through the replica that does not run the agent: two follow-ups, one canceled.
    let kept = send(&b, &id, json!({"text": "kept"})).await;
    let dropped = send(&b, &id, json!({"text": "dropped"})).await;
    assert_eq!(kept["queued"], true, "{kept}");
    assert_eq!(dropped["position"], 2, "{dropped}");
    let listed = b
        .get_ok(&format!("/v1/agents/{id}/messages?state=queued"))
        .await;
    assert_eq!(listed["items"].as_array().unwrap().len(), 2, "{listed}");
    // Its queue, as the other replica shows it: the agent waits for its own turn.
    let queue = b.get_ok("/v1/queue").await;
    assert_eq!(queue["items"].as_array().unwrap().len(), 1, "{queue}");
    let entry = &queue["items"][0];
    assert_eq!(entry["agent_id"], id.as_str(), "{queue}");
    assert_eq!(entry["waiting_for"], "agent_busy", "{queue}");
    assert_eq!(entry["messages"], 2, "{queue}");
    assert_eq!(entry["message_id"], kept["message_id"], "{queue}");
    let shown = b.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(shown["status"], "waiting_permission", "{shown}");
    assert_eq!(shown["queue"]["messages"], 2, "{shown}");
    let cancel = b
        .delete(&format!(
            "/v1/agents/{id}/messages/{}",
            dropped["message_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(cancel.status(), 204);
    b.post_ok(
        &format!("/v1/agents/{id}/permissions/{request}"),
        json!({"behavior": "allow"}),
        200,
    )
    .await;
    let events = until_turns(&b, &id, 2).await;
    assert_eq!(user_texts(&events), ["/ask hold on?", "kept"]);
    let agent = b.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(
        agent["runtime"]["replica"], owner,
        "the follow-up ran where the agent runs"
    );
    let all = b.get_ok(&format!("/v1/agents/{id}/messages")).await;
    let states: Vec<&str> = all["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["started", "canceled"]);
}

/// A waiting hook that answers (204) only when released: each request it holds is told on
/// `arrived`.
struct HeldHook {
    url: String,
    arrived: tokio::sync::mpsc::UnboundedReceiver<()>,
    release: std::sync::Arc<tokio::sync::Notify>,
}

impl HeldHook {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/open", listener.local_addr().unwrap());
        let (tx, arrived) = tokio::sync::mpsc::unbounded_channel();
        let release = std::sync::Arc::new(tokio::sync::Notify::new());
        let r = release.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (tx, r) = (tx.clone(), r.clone());
                tokio::spawn(async move {
                    use tokio::io::AsyncWriteExt;
                    if crate::hooks::http::read_request(&mut stream)
                        .await
                        .is_none()
                    {
                        return;
                    }
                    let released = r.notified();
                    let _ = tx.send(());
                    released.await;
                    let _ = stream
                        .write_all(
                            b"HTTP/1.1 204 X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                        )
                        .await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Self {
            url,
            arrived,
            release,
        }
    }
}

/// Held by a server while it admits a turn against the running-turn limits.
async fn admission_locks(app: &TestApp) -> i64 {
    // The key of `pg_advisory_xact_lock(0x6167_656e_7471_7565)`, as `pg_locks` splits it.
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks
          WHERE locktype = 'advisory' AND classid::bigint = 1634166126
            AND objid::bigint = 1953592677
            AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_slow_reopen_under_the_limits_holds_up_no_other_turn_start() {
    let app = spawn_app_with(|s| {
        s.limits.max_running_turns = 10;
        s.hooks.allow_private_networks = true;
        s.hooks.timeout_s = 120;
    })
    .await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let closed = app.agent_in_new_workspace(&project, "mock").await;
    let live = app.agent_in_new_workspace(&project, "mock").await;
    app.post_ok(&format!("/v1/agents/{closed}/close"), json!({}), 200)
        .await;
    let mut hook = HeldHook::start().await;
    app.post_ok(
        "/v1/hooks",
        json!({"name": "slow-open", "events": ["agent.open.before"], "url": hook.url,
            "secret": "whsec_test_0123456789"}),
        201,
    )
    .await;

    // A prompt reopens the closed agent; its `agent.open.before` hook holds the reopen.
    let reopen = tokio::spawn({
        let (client, url, token) = (
            app.client.clone(),
            app.url(&format!("/v1/agents/{closed}/messages")),
            app.token.clone(),
        );
        async move {
            let res = client
                .post(url)
                .bearer_auth(token)
                .json(&json!({"text": "hello"}))
                .send()
                .await
                .unwrap();
            (res.status().as_u16(), res.json::<Value>().await.unwrap())
        }
    });
    tokio::time::timeout(Duration::from_secs(60), hook.arrived.recv())
        .await
        .expect("the reopen called its hook")
        .unwrap();

    // Meanwhile nothing holds the admission: another agent's prompt starts its turn now,
    // not once the reopen is done.
    assert_eq!(admission_locks(&app).await, 0, "the reopen holds the lock");
    let started = tokio::time::timeout(
        Duration::from_secs(30),
        send(&app, &live, json!({"text": "hello"})),
    )
    .await
    .expect("a turn start waited for another agent's reopen");
    assert_eq!(started["queued"], false, "{started}");
    assert!(started["turn_id"].is_string(), "{started}");
    assert_eq!(app.wait(&live).await["last_turn"]["outcome"], "completed");

    // Released, the reopened agent runs its prompt.
    hook.release.notify_waiters();
    let (status, body) = tokio::time::timeout(Duration::from_secs(60), reopen)
        .await
        .expect("the reopen's prompt answered")
        .unwrap();
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["queued"], false, "{body}");
    assert!(body["turn_id"].is_string(), "{body}");
    assert_eq!(app.wait(&closed).await["last_turn"]["outcome"], "completed");
}

#[tokio::test]
async fn a_first_prompt_given_at_creation_waits_for_a_running_turn_slot() {
    let app = spawn_app_with(|s| s.limits.max_running_turns = 1).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let busy = app.agent_in_new_workspace(&project, "mock").await;
    let started = send(&app, &busy, json!({"text": "/ask hold?"})).await;
    assert_eq!(started["queued"], false, "{started}");
    let w = app.wait(&busy).await;
    assert_eq!(w["status"], "waiting_permission", "{w}");
    let request = w["pending_permissions"][0]["request_id"]
        .as_str()
        .unwrap()
        .to_owned();

    // The one slot is taken: the new agent's first prompt waits for it.
    let ws = app
        .post_ok("/v1/workspaces", json!({"project_id": project["id"]}), 201)
        .await;
    let created = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "prompt": "hello"}),
            201,
        )
        .await;
    let id = created["id"].as_str().unwrap().to_owned();
    assert_eq!(created["status"], "queued", "{created}");
    assert_eq!(created["queue"]["waiting_for"], "capacity", "{created}");
    let queue = app.get_ok("/v1/queue").await;
    assert_eq!(queue["running"], 1, "{queue}");
    let items = queue["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{queue}");
    assert_eq!(items[0]["agent_id"], id.as_str(), "{queue}");

    // The slot frees: the first prompt runs.
    app.post_ok(
        &format!("/v1/agents/{busy}/permissions/{request}"),
        json!({"behavior": "allow"}),
        200,
    )
    .await;
    let events = until_turns(&app, &id, 1).await;
    assert_eq!(user_texts(&events), ["hello"]);
    assert!(
        app.get_ok("/v1/queue").await["items"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}
