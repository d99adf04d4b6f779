//! `GET /metrics`: Prometheus text that counts what really happened on this server.

use serde_json::json;
use std::time::Duration;

use crate::helpers::*;

/// The value of the sample `series` (name and labels exactly as rendered).
pub(crate) fn sample(page: &str, series: &str) -> Option<f64> {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

pub(crate) async fn scrape(app: &TestApp) -> String {
    let res = app.client.get(app.url("/metrics")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let ct = res.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    res.text().await.unwrap()
}

#[tokio::test]
async fn metrics_count_agents_turns_events_requests_and_streams() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (agent, _) = app.mock_agent(repo.path()).await;
    app.prompt(&agent, "hello").await;
    assert_eq!(app.wait(&agent).await["last_turn"]["outcome"], "completed");
    app.get_ok(&format!("/v1/agents/{agent}")).await;
    let mut stream = app.events(&agent, None).await;
    stream.next(Duration::from_secs(5)).await.expect("an event");

    let page = scrape(&app).await;
    assert_eq!(
        sample(
            &page,
            r#"agentry_turns_total{provider="mock",outcome="completed"}"#
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        sample(&page, r#"agentry_turns_started_total{provider="mock"}"#),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        sample(
            &page,
            r#"agentry_provider_sessions_total{provider="mock",start="new"}"#
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        sample(&page, "agentry_lease_takeovers_total"),
        Some(0.0),
        "{page}"
    );
    // A closed agent's next prompt starts its process again: a resume.
    app.post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    app.prompt(&agent, "again").await;
    assert_eq!(app.wait(&agent).await["last_turn"]["outcome"], "completed");
    let page = scrape(&app).await;
    assert_eq!(
        sample(
            &page,
            r#"agentry_provider_sessions_total{provider="mock",start="resume"}"#
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        sample(&page, r#"agentry_turns_started_total{provider="mock"}"#),
        Some(2.0),
        "{page}"
    );
    let agents: f64 = page
        .lines()
        .filter(|l| l.starts_with("agentry_agents{") && l.contains(r#"provider="mock""#))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(agents, 1.0, "{page}");

    let written = sample(&page, "agentry_events_written_total").unwrap();
    let timeline = app.timeline(&agent).await.len() as f64;
    assert!(written >= timeline, "{written} < {timeline}");
    let batches = sample(&page, "agentry_writer_batch_events_count").unwrap();
    assert!(batches >= 1.0 && batches <= written + 10.0, "{batches}");
    assert_eq!(
        sample(&page, "agentry_writer_commit_seconds_count"),
        Some(batches),
        "one commit time per batch"
    );
    assert!(sample(&page, "agentry_sse_subscribers").unwrap() >= 1.0);
    assert_eq!(
        sample(&page, "agentry_provider_processes"),
        Some(1.0),
        "{page}"
    );
    assert!(sample(&page, r#"agentry_db_connections{state="idle"}"#).is_some());

    // Requests by route template, never by raw path.
    assert_eq!(
        sample(
            &page,
            r#"agentry_http_requests_total{method="GET",route="/v1/agents/{id}",status="200"}"#
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        sample(
            &page,
            r#"agentry_http_requests_total{method="POST",route="/v1/agents",status="201"}"#
        ),
        Some(1.0)
    );
    assert!(
        sample(
            &page,
            r#"agentry_http_request_duration_seconds_count{route="/v1/agents/{id}/messages"}"#
        )
        .is_some(),
        "{page}"
    );
    assert!(!page.contains("agt_"), "no agent id in a label");
    app.get("/no/such/route").await;
    let page = scrape(&app).await;
    assert_eq!(
        sample(
            &page,
            r#"agentry_http_requests_total{method="GET",route="unmatched",status="404"}"#
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn a_metrics_token_closes_the_page_to_others() {
    let token = "metrics-token-0123456789";
    let app = spawn_app_with(|s| {
        s.metrics.token = Some(agentry::config::Secret::new(token));
    })
    .await;
    let res = app.client.get(app.url("/metrics")).send().await.unwrap();
    assert_eq!(expect_status(res, 401).await["code"], "token_missing");
    let res = app
        .client
        .get(app.url("/metrics"))
        .bearer_auth("metrics-token-wrong-000000")
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(res, 401).await["code"], "token_invalid");
    // An API token is not the metrics token.
    let res = app
        .client
        .get(app.url("/metrics"))
        .bearer_auth(&app.token)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 401);
    let res = app
        .client
        .get(app.url("/metrics"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let page = res.text().await.unwrap();
    assert!(page.contains("# TYPE agentry_turns_total counter"));
}
