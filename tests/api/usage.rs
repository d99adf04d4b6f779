//! Usage as the timeline carries it (what the dashboard's chart is drawn from), with the
//! mock's `/usage <input> <output>` turn.

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
