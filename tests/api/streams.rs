//! SSE: resume at a random point under load, durability, and the team activity stream.

use std::collections::BTreeSet;
use std::time::Duration;

use rand::Rng;
use serde_json::json;

use crate::helpers::*;

#[tokio::test]
async fn resume_under_load_gives_every_event_exactly_once() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    let mut sse = app.events(&id, None).await;
    app.prompt(&id, "/load 2000 0").await;
    let cut = seeded_rng("resume_under_load_gives_every_event_exactly_once").random_range(20..1500);
    let mut first = Vec::new();
    while first.len() < cut {
        first.push(
            sse.next(Duration::from_secs(10))
                .await
                .expect("events flow"),
        );
    }
    drop(sse);
    let last = first.last().unwrap().id;
    let mut sse = app.events(&id, Some(last)).await;
    let second = sse.until("turn_completed", Duration::from_secs(20)).await;
    let ids: Vec<i64> = first.iter().chain(second.iter()).map(|e| e.id).collect();
    let expected: Vec<i64> = (1..=*ids.last().unwrap()).collect();
    assert_eq!(
        ids, expected,
        "the union is exactly 1..N, in order, without duplicates"
    );
    let deltas = first
        .iter()
        .chain(second.iter())
        .filter(|e| e.event == "assistant_delta")
        .count();
    assert_eq!(deltas, 2000);

    // Durable: what SSE showed is what the database holds.
    let rows: Vec<(i64, String, serde_json::Value)> =
        sqlx::query_as("SELECT seq, kind, data FROM agent_events WHERE agent_id = $1 ORDER BY seq")
            .bind(uuid::Uuid::parse_str(&id[4..]).unwrap())
            .fetch_all(&app.pool)
            .await
            .unwrap();
    for e in first.iter().chain(second.iter()) {
        let row = &rows[(e.id - 1) as usize];
        assert_eq!(row.0, e.id);
        assert_eq!(row.1, e.event);
        assert_eq!(row.2, e.data["data"]);
    }
    // `?after_seq=` resumes too.
    let n = *ids.last().unwrap();
    let res = app
        .client
        .get(app.url(&format!("/v1/agents/{id}/events?after_seq={}", n - 1)))
        .bearer_auth(&app.token)
        .send()
        .await
        .unwrap();
    let mut r = SseReader::from_response(res);
    assert_eq!(
        r.next(Duration::from_secs(5))
            .await
            .expect("the last event")
            .id,
        n
    );
}

#[tokio::test]
async fn team_activity_stream_is_resumable() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, ws) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    let res = app
        .client
        .get(app.url("/v1/events"))
        .bearer_auth(&app.token)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let mut r = SseReader::from_response(res);
    let evs = r.until("agent_status", Duration::from_secs(10)).await;
    assert_eq!(evs[0].event, "workspace_created");
    assert!(
        evs.iter()
            .any(|e| e.event == "agent_created" && e.data["data"]["agent_id"] == id.as_str())
    );
    let seen: BTreeSet<i64> = evs.iter().map(|e| e.id).collect();
    let last = *seen.iter().last().unwrap();
    let res = app
        .client
        .get(app.url(&format!("/v1/events?workspace_id={ws}")))
        .bearer_auth(&app.token)
        .header("Last-Event-ID", last.to_string())
        .send()
        .await
        .unwrap();
    let mut r = SseReader::from_response(res);
    app.post_ok(&format!("/v1/workspaces/{ws}/archive"), json!({}), 200)
        .await;
    let more = r.until("workspace_archived", Duration::from_secs(10)).await;
    assert!(more.iter().all(|e| e.id > last));
}

/// A client that stops reading never slows the agent down; when it reads again it gets
/// every event, in order, resynchronised from the database.
#[tokio::test]
async fn a_slow_reader_does_not_slow_the_writer_and_loses_nothing() {
    let app = spawn_app_with(|s| s.events.subscriber_buffer = 16).await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    let mut stalled = app.events(&id, None).await;
    let first = stalled.next(Duration::from_secs(5)).await.unwrap();
    assert_eq!(first.id, 1);
    app.prompt(&id, "/load 40000 0").await;
    let w = app.wait(&id).await;
    assert_eq!(
        w["last_turn"]["outcome"], "completed",
        "the turn finished while a reader stalled"
    );
    let total = app.get_ok(&format!("/v1/agents/{id}")).await["last_seq"]
        .as_i64()
        .unwrap();
    let mut next = 2;
    while next <= total {
        let e = stalled
            .next(Duration::from_secs(10))
            .await
            .expect("the stalled reader catches up");
        assert_eq!(e.id, next, "in order, nothing missing, nothing twice");
        next += 1;
    }
}

#[tokio::test]
async fn mode_and_model_changes_are_recorded() {
    let app = spawn_app().await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    let r = app
        .client
        .put(app.url(&format!("/v1/agents/{id}/mode")))
        .bearer_auth(&app.token)
        .json(&json!({"mode": "unattended"}))
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(r, 200).await["mode"], "unattended");
    let r = app
        .client
        .put(app.url(&format!("/v1/agents/{id}/mode")))
        .bearer_auth(&app.token)
        .json(&json!({"mode": "warp"}))
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(r, 422).await["code"], "validation_failed");
    let r = app
        .client
        .put(app.url(&format!("/v1/agents/{id}/model")))
        .bearer_auth(&app.token)
        .json(&json!({"model": "mock-large"}))
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(r, 200).await["model"], "mock-large");
    let events = app.timeline(&id).await;
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "mode_changed" && e["data"]["mode"] == "unattended")
    );
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "model_changed" && e["data"]["model"] == "mock-large")
    );
    // A closed agent keeps the change for its next session.
    app.post_ok(&format!("/v1/agents/{id}/close"), json!({}), 200)
        .await;
    let r = app
        .client
        .put(app.url(&format!("/v1/agents/{id}/mode")))
        .bearer_auth(&app.token)
        .json(&json!({"mode": "default"}))
        .send()
        .await
        .unwrap();
    assert_eq!(expect_status(r, 200).await["mode"], "default");
    app.prompt(&id, "hi").await;
    app.wait(&id).await;
    assert_eq!(
        app.get_ok(&format!("/v1/agents/{id}")).await["mode"],
        "default"
    );
}

/// `retry:` once at the start, `: live` once the replay is done, then `: ping` comments
/// while nothing happens.
#[tokio::test]
async fn idle_streams_get_keep_alive_comments() {
    use futures::StreamExt;
    let app = spawn_app_with(|s| s.events.ping_interval_s = 1).await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;
    let res = app
        .client
        .get(app.url(&format!("/v1/agents/{id}/events")))
        .bearer_auth(&app.token)
        .send()
        .await
        .unwrap();
    let mut body = res.bytes_stream();
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while text.matches(": ping\n\n").count() < 2 {
        match tokio::time::timeout_at(deadline, body.next()).await {
            Ok(Some(Ok(chunk))) => text.push_str(&String::from_utf8_lossy(&chunk)),
            _ => panic!("no keep-alive within 5 s; got {text:?}"),
        }
    }
    assert!(text.starts_with("retry: 3000\n\n"));
    assert_eq!(text.matches("retry:").count(), 1);
    // The replay of the finished agent, then once `: live`, then only keep-alives.
    let live = text
        .find(": live\n\n")
        .expect("a `: live` comment after the replay");
    assert_eq!(text.matches(": live").count(), 1);
    assert!(text[..live].contains("event: status"), "{text:?}");
    assert!(!text[live..].contains("id: "), "{text:?}");
    assert!(live < text.find(": ping").unwrap(), "{text:?}");
}

/// Open an agent's stream and the team's, raw, each read until its `retry:` line.
async fn two_streams(
    app: &TestApp,
    agent: &str,
) -> Vec<impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin + use<>> {
    use futures::StreamExt;
    let mut out = Vec::new();
    for path in [
        format!("/v1/agents/{agent}/events"),
        "/v1/events".to_owned(),
    ] {
        let res = app
            .client
            .get(app.url(&path))
            .bearer_auth(&app.token)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{path}");
        let mut body = Box::pin(res.bytes_stream());
        let first = tokio::time::timeout(Duration::from_secs(5), body.next())
            .await
            .expect("a first chunk within 5 s");
        let first = first.expect("a first chunk").unwrap();
        assert!(first.starts_with(b"retry: 3000\n\n"), "{path}: {first:?}");
        out.push(body);
    }
    out
}

async fn subscribers(app: &TestApp) -> f64 {
    let page = crate::metrics::scrape(app).await;
    crate::metrics::sample(&page, "agentry_sse_subscribers").unwrap()
}

#[tokio::test]
async fn a_stream_ends_when_its_client_leaves_and_when_the_server_stops() {
    use futures::StreamExt;
    // The server notices a client left at the stream's next write: here, a ping.
    let app = spawn_app_with(|s| s.events.ping_interval_s = 1).await;
    let repo = git_repo();
    let (id, _) = app.mock_agent(repo.path()).await;
    app.wait(&id).await;

    let streams = two_streams(&app, &id).await;
    assert_eq!(subscribers(&app).await, 2.0);
    drop(streams);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while subscribers(&app).await > 0.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "streams whose clients left still listen after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A graceful stop ends open streams cleanly, well before the server's 10 s grace.
    let streams = two_streams(&app, &id).await;
    let stop = tokio::spawn(app.stop());
    for mut body in streams {
        let end = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match body.next().await {
                    Some(Ok(_)) => continue,
                    other => return other.map(|r| r.map(|_| ())),
                }
            }
        })
        .await
        .expect("the stream ends within 5 s of the stop");
        assert!(end.is_none(), "a clean end of the stream, not {end:?}");
    }
    tokio::time::timeout(Duration::from_secs(5), stop)
        .await
        .expect("the server stops")
        .unwrap();
}
