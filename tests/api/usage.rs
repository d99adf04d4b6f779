//! Usage as the timeline carries it (what the dashboard's chart is drawn from), with the
//! mock's `/usage <input> <output>` turn; the usage ledger (one row per turn) and
//! `GET /v1/usage`, reconciled against the timeline.

use serde_json::{Value, json};

use crate::helpers::*;

#[tokio::test]
async fn a_turn_reports_its_tokens_context_window_and_cost() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, _) = app.mock_agent(repo.path()).await;
    app.wait(&agent).await;
    app.prompt(&agent, "/usage 1200 340").await;
    let done = app.wait(&agent).await;
    assert_eq!(done["last_turn"]["outcome"], "completed");
    let timeline = app.timeline(&agent).await;
    let usage = timeline
        .iter()
        .rfind(|e| e["kind"] == "usage")
        .unwrap_or_else(|| panic!("a usage event: {timeline:?}"));
    assert_eq!(usage["data"]["context_window_used"], 1540);
    assert_eq!(usage["data"]["context_window_max"], 200_000);
    let cost = usage["data"]["cost_usd"].as_f64().unwrap();
    assert!((cost - 0.0087).abs() < 1e-9, "{cost}");
    let end = timeline
        .iter()
        .rfind(|e| e["kind"] == "turn_completed")
        .unwrap();
    assert_eq!(end["data"]["usage"]["input_tokens"], 1200);
    assert_eq!(end["data"]["usage"]["output_tokens"], 340);
    assert_eq!(usage["turn_id"], end["turn_id"]);
}

/// The team the admin's resources go to (its default team).
pub async fn default_team(app: &TestApp) -> String {
    let me = app.get_ok("/v1/me").await;
    me["default_team_id"]
        .as_str()
        .unwrap_or_else(|| panic!("a default team in {me}"))
        .to_owned()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[tokio::test]
async fn each_turn_is_one_ledger_row_grouped_by_day_person_provider_model_and_project() {
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let agent = app.agent_in_new_workspace(&project, "mock").await;
    let team = default_team(&app).await;
    app.prompt(&agent, "/usage 1200 340").await;
    app.wait(&agent).await;
    app.prompt(&agent, "/usage 100 10").await;
    app.wait(&agent).await;
    app.prompt(&agent, "hello").await;
    app.wait(&agent).await;

    let report = app.get_ok(&format!("/v1/usage?team_id={team}")).await;
    let totals = &report["totals"];
    assert_eq!(totals["turns"], 3, "{report}");
    assert_eq!(totals["input_tokens"], 1300, "{report}");
    assert_eq!(totals["output_tokens"], 350, "{report}");
    assert_eq!(totals["cached_input_tokens"], 0, "{report}");
    let expected = (1300.0 * 3.0 + 350.0 * 15.0) / 1_000_000.0;
    assert!(
        close(totals["cost_usd"].as_f64().unwrap(), expected),
        "{report}"
    );
    // The mock reports its cost: nothing is estimated.
    assert_eq!(totals["estimated_cost_usd"], 0.0, "{report}");
    assert!(report["groups"].as_array().unwrap().is_empty());

    let me = app.get_ok("/v1/me").await;
    let model = app.get_ok(&format!("/v1/agents/{agent}")).await["model"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    let today = chrono::Utc::now().format("%Y-%m-%d").to_string();
    for (group, key) in [
        ("day", json!(today)),
        ("person", me["id"].clone()),
        ("provider", json!("mock")),
        ("model", json!(model)),
        ("project", project["id"].clone()),
    ] {
        let report = app
            .get_ok(&format!("/v1/usage?team_id={team}&group_by={group}"))
            .await;
        let groups = report["groups"].as_array().unwrap();
        assert_eq!(groups.len(), 1, "{group}: {report}");
        assert_eq!(groups[0]["key"], key, "{group}: {report}");
        assert_eq!(groups[0]["turns"], 3, "{group}: {report}");
        assert_eq!(groups[0]["input_tokens"], 1300, "{group}: {report}");
    }

    // A window that ends before the turns holds none of them; a bad grouping is refused.
    let empty = app
        .get_ok(&format!(
            "/v1/usage?team_id={team}&from=2020-01-01&to=2020-02-01"
        ))
        .await;
    assert_eq!(empty["totals"]["turns"], 0, "{empty}");
    let bad = app
        .get(&format!("/v1/usage?team_id={team}&group_by=agent"))
        .await;
    assert_eq!(expect_status(bad, 422).await["code"], "validation_failed");

    // The metrics count what the ledger holds, by team and provider.
    let metrics = app.client.get(app.url("/metrics")).send().await.unwrap();
    let text = metrics.text().await.unwrap();
    let line =
        format!("agentry_tokens_total{{team=\"{team}\",provider=\"mock\",kind=\"input\"}} 1300");
    assert!(text.contains(&line), "{line} in:\n{text}");
    let cost = text
        .lines()
        .find(|l| {
            l.starts_with(&format!(
                "agentry_cost_usd_total{{team=\"{team}\",provider=\"mock\"}}"
            ))
        })
        .unwrap_or_else(|| panic!("a cost line in:\n{text}"));
    let value: f64 = cost.rsplit(' ').next().unwrap().parse().unwrap();
    assert!((value - expected).abs() < 1e-6, "{cost}");
}

#[tokio::test]
async fn the_ledger_agrees_with_a_replay_of_the_timelines_usage() {
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let team = default_team(&app).await;
    let mut agents = Vec::new();
    for prompts in [
        &["/usage 500 20", "/spend 300 40 3 0", "hi"][..],
        &["/usage 7 3", "/spend 1000 1 2 0"][..],
    ] {
        let agent = app.agent_in_new_workspace(&project, "mock").await;
        for p in prompts {
            app.prompt(&agent, p).await;
            app.wait(&agent).await;
        }
        agents.push(agent);
    }

    // Replay: per turn, the tokens its end reports and the cost of its last usage event
    // (each usage event counts the turn so far).
    let (mut turns, mut input, mut output, mut cost) = (0, 0, 0, 0.0);
    for agent in &agents {
        let timeline = app.timeline(agent).await;
        let mut turn_cost: std::collections::HashMap<String, f64> = Default::default();
        for e in &timeline {
            let turn = e["turn_id"].as_str().unwrap_or_default().to_owned();
            match e["kind"].as_str() {
                Some("usage") => {
                    if let Some(c) = e["data"]["cost_usd"].as_f64() {
                        turn_cost.insert(turn, c);
                    }
                }
                Some("turn_completed") => {
                    turns += 1;
                    input += e["data"]["usage"]["input_tokens"].as_i64().unwrap_or(0);
                    output += e["data"]["usage"]["output_tokens"].as_i64().unwrap_or(0);
                    cost += turn_cost.get(&turn).copied().unwrap_or(0.0);
                }
                _ => {}
            }
        }
    }
    assert_eq!(turns, 5);
    assert_eq!(input, 500 + 900 + 7 + 2000);
    let report = app.get_ok(&format!("/v1/usage?team_id={team}")).await;
    let totals = &report["totals"];
    assert_eq!(totals["turns"], turns, "{report}");
    assert_eq!(totals["input_tokens"], input, "{report}");
    assert_eq!(totals["output_tokens"], output, "{report}");
    assert!(
        (totals["cost_usd"].as_f64().unwrap() - cost).abs() < 1e-9,
        "{cost} vs {report}"
    );
}

#[tokio::test]
async fn a_cli_that_reports_no_cost_is_priced_from_the_settings_and_marked_estimated() {
    let app = spawn_app_with(|s| {
        let mut models = std::collections::BTreeMap::new();
        models.insert(
            "*".to_owned(),
            agentry::config::Price {
                input_per_mtok: 2.0,
                output_per_mtok: 10.0,
                cached_per_mtok: None,
            },
        );
        s.usage.prices.insert("mock".into(), models);
    })
    .await;
    let repo = git_repo();
    let (agent, _) = app.mock_agent(repo.path()).await;
    app.wait(&agent).await;
    let team = default_team(&app).await;
    app.prompt(&agent, "/tokens 4000 500").await;
    app.wait(&agent).await;
    // The mock reports this one's cost itself: it stays as reported.
    app.prompt(&agent, "/usage 1000 100").await;
    app.wait(&agent).await;
    let report = app.get_ok(&format!("/v1/usage?team_id={team}")).await;
    let estimated = (4000.0 * 2.0 + 500.0 * 10.0) / 1_000_000.0;
    let reported = (1000.0 * 3.0 + 100.0 * 15.0) / 1_000_000.0;
    let totals = &report["totals"];
    assert!(
        close(totals["estimated_cost_usd"].as_f64().unwrap(), estimated),
        "{report}"
    );
    assert!(
        close(totals["cost_usd"].as_f64().unwrap(), estimated + reported),
        "{report}"
    );
}

#[test]
fn a_malformed_price_table_is_refused_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agentry.toml");
    for (text, setting) in [
        (
            "[usage.prices.claude.\"claude-sonnet\"]\ninput_per_mtok = -3\noutput_per_mtok = 15\n",
            "usage.prices.claude.claude-sonnet.input_per_mtok",
        ),
        (
            "[usage.prices.claude.\"claude-sonnet\"]\ninput_per_mtok = 3\n",
            "usage.prices.claude.claude-sonnet",
        ),
        (
            "[usage.prices.claude.\"claude-sonnet\"]\ninput_per_mtok = 3\noutput_per_mtok = 15\nper_request = 1\n",
            "usage.prices.claude.claude-sonnet",
        ),
    ] {
        std::fs::write(&file, text).unwrap();
        let e = agentry::config::Settings::load_from(Some(&file), &[]).unwrap_err();
        assert!(
            e.setting.starts_with(setting),
            "{text}: {} ({})",
            e.setting,
            e.message
        );
    }
    std::fs::write(
        &file,
        "[usage.prices.claude.\"claude-sonnet\"]\ninput_per_mtok = 3\noutput_per_mtok = 15\ncached_per_mtok = 0.3\n",
    )
    .unwrap();
    let s = agentry::config::Settings::load_from(Some(&file), &[]).unwrap();
    assert_eq!(
        s.usage
            .price("claude", Some("claude-sonnet"))
            .unwrap()
            .cached_per_mtok,
        Some(0.3)
    );
}

#[tokio::test]
async fn another_teams_usage_is_missing_and_an_admin_sees_every_team() {
    let app = spawn_app().await;
    let team = default_team(&app).await;
    let ana = crate::people::person(&app, "ana").await;
    let own = crate::people::team(&ana, "ana-team").await;
    ana.api
        .refused(
            reqwest::Method::GET,
            &format!("/v1/usage?team_id={team}"),
            None,
            404,
            "not_found",
        )
        .await;
    ana.api
        .refused(
            reqwest::Method::GET,
            &format!("/v1/teams/{team}/budget"),
            None,
            404,
            "not_found",
        )
        .await;
    let mine = ana
        .api
        .ok(
            reqwest::Method::GET,
            &format!("/v1/usage?team_id={own}"),
            None,
            200,
        )
        .await;
    assert_eq!(mine["totals"]["turns"], 0);
    let seen = app.get_ok(&format!("/v1/usage?team_id={own}")).await;
    assert_eq!(seen["team_id"], own.as_str());
}

#[tokio::test]
async fn a_service_tokens_turns_are_the_tokens_not_its_issuers() {
    let app = spawn_app().await;
    let team = default_team(&app).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let svc = app
        .post_ok(
            "/v1/tokens",
            json!({"name": "ci", "team_id": team, "role": "member"}),
            201,
        )
        .await;
    let bot = crate::people::Caller::new(&app, svc["token"].as_str().unwrap());
    let ws = bot
        .ok(
            reqwest::Method::POST,
            "/v1/workspaces",
            Some(json!({"project_id": project["id"]})),
            201,
        )
        .await;
    let agent = bot
        .ok(
            reqwest::Method::POST,
            "/v1/agents",
            Some(json!({"workspace_id": ws["id"], "provider": "mock"})),
            201,
        )
        .await;
    let agent = agent["id"].as_str().unwrap().to_owned();
    app.wait(&agent).await;
    app.prompt(&agent, "/usage 10 1").await;
    app.wait(&agent).await;
    let mine = app.agent_in_new_workspace(&project, "mock").await;
    app.prompt(&mine, "/usage 20 2").await;
    app.wait(&mine).await;

    let me = app.get_ok("/v1/me").await;
    let report = app
        .get_ok(&format!("/v1/usage?team_id={team}&group_by=person"))
        .await;
    let groups: Vec<(Value, Value)> = report["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (g["key"].clone(), g["input_tokens"].clone()))
        .collect();
    let mut want = vec![
        (svc["id"].clone(), json!(10)),
        (me["id"].clone(), json!(20)),
    ];
    want.sort_by_key(|(k, _)| k.as_str().unwrap().to_owned());
    let mut got = groups.clone();
    got.sort_by_key(|(k, _)| k.as_str().unwrap().to_owned());
    assert_eq!(got, want, "{report}");
}
