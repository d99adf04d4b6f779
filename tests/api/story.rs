//! The whole CI-bot story from the issue, end to end, as one test.

use std::time::Duration;

use serde_json::json;

use crate::helpers::*;

#[tokio::test]
async fn ci_bot_story() {
    let app = spawn_app().await;
    let repo = git_repo();

    let project = app.project(repo.path()).await;
    assert_eq!(project["default_branch"], "main");
    let ws = app
        .post_ok(
            "/v1/workspaces",
            json!({"project_id": project["id"], "title": "CI run"}),
            201,
        )
        .await;
    assert_eq!(ws["branch"], "agentry/ci-run");
    let wpath = path_of(&ws["path"]);
    assert!(
        wpath.starts_with(app.data_dir.path()),
        "worktrees live under the data dir"
    );

    // Open a mock agent with a first prompt, idempotently.
    let body = json!({"workspace_id": ws["id"], "provider": "mock", "prompt": "hello there", "labels": {"ci_run": "1234"}});
    let send = || {
        app.client
            .post(app.url("/v1/agents"))
            .bearer_auth(&app.token)
            .header("Idempotency-Key", "run-1234")
            .json(&body)
            .send()
    };
    let agent = expect_status(send().await.unwrap(), 201).await;
    let again = expect_status(send().await.unwrap(), 200).await;
    assert_eq!(
        agent["id"], again["id"],
        "same key, same body: the same agent"
    );
    let other = app
        .client
        .post(app.url("/v1/agents"))
        .bearer_auth(&app.token)
        .header("Idempotency-Key", "run-1234")
        .json(&json!({"workspace_id": ws["id"], "provider": "mock"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        expect_status(other, 409).await["code"],
        "idempotency_key_reused"
    );
    let id = agent["id"].as_str().unwrap().to_owned();
    let labelled = app.get_ok("/v1/agents?label=ci_run:1234").await;
    assert_eq!(
        labelled["items"].as_array().unwrap().len(),
        1,
        "the label filter finds the agent"
    );
    assert_eq!(labelled["items"][0]["id"], id.as_str());
    let other = app.get_ok("/v1/agents?label=ci_run:999").await;
    assert!(other["items"].as_array().unwrap().is_empty());

    // Follow live, drop halfway, resume with Last-Event-ID.
    let mut sse = app.events(&id, None).await;
    let first = sse.until("assistant_delta", Duration::from_secs(10)).await;
    let last_id = first.last().unwrap().id;
    drop(sse);
    let mut sse = app.events(&id, Some(last_id)).await;
    let rest = sse.until("turn_completed", Duration::from_secs(10)).await;
    assert_eq!(rest[0].id, last_id + 1, "resumes right after the last id");
    let ids: Vec<i64> = first.iter().chain(rest.iter()).map(|e| e.id).collect();
    assert_eq!(
        ids,
        (1..=ids.len() as i64).collect::<Vec<_>>(),
        "every event once, in order"
    );

    // A permission request, answered over REST.
    app.prompt(&id, "/ask deploy?").await;
    let asked = sse
        .until("permission_requested", Duration::from_secs(10))
        .await;
    let req = asked.last().unwrap().data["data"].clone();
    let waited = app.wait(&id).await;
    assert_eq!(waited["status"], "waiting_permission");
    assert_eq!(
        waited["pending_permissions"][0]["request_id"],
        req["request_id"]
    );
    let path = format!(
        "/v1/agents/{id}/permissions/{}",
        req["request_id"].as_str().unwrap()
    );
    let answered = app.post_ok(&path, json!({"behavior": "allow"}), 200).await;
    assert_eq!(answered["status"], "resolved");
    let after = sse.until("turn_completed", Duration::from_secs(10)).await;
    let reply = after
        .iter()
        .find(|e| e.event == "assistant_message")
        .expect("a reply");
    let text = reply.data["data"]["text"].as_str().unwrap();
    assert!(
        text.contains("allow"),
        "the reply names the behavior: {text}"
    );
    assert_eq!(after.last().unwrap().data["data"]["outcome"], "completed");
    let waited = app.wait(&id).await;
    assert_eq!(waited["status"], "idle");
    assert_eq!(waited["timed_out"], false);
    assert_eq!(waited["last_turn"]["outcome"], "completed");

    // The mock writes a file; the diff shows it.
    app.prompt(&id, "/write notes.txt hello").await;
    app.wait(&id).await;
    let diff = app
        .get_ok(&format!(
            "/v1/workspaces/{}/diff",
            ws["id"].as_str().unwrap()
        ))
        .await;
    let file = diff["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == "notes.txt")
        .expect("notes.txt in the diff");
    assert_eq!(file["status"], "added");
    assert!(diff["patch"].as_str().unwrap().contains("+hello"));

    // Page through the timeline in small pages; the union is the whole timeline.
    let all = app.timeline(&id).await;
    let mut paged = Vec::new();
    let mut path = format!("/v1/agents/{id}/timeline?after_seq=0&limit=7");
    loop {
        let page = app.get_ok(&path).await;
        paged.extend(
            page["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["seq"].as_i64().unwrap()),
        );
        match page["next_cursor"].as_str() {
            Some(c) => path = format!("/v1/agents/{id}/timeline?cursor={c}&limit=7"),
            None => break,
        }
    }
    assert_eq!(
        paged,
        all.iter()
            .map(|e| e["seq"].as_i64().unwrap())
            .collect::<Vec<_>>()
    );
    let tail = app
        .get_ok(&format!(
            "/v1/agents/{id}/timeline?before_seq={}&limit=3",
            all.len() + 1
        ))
        .await;
    let tail_seqs: Vec<i64> = tail["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_i64().unwrap())
        .collect();
    let n = all.len() as i64;
    assert_eq!(
        tail_seqs,
        vec![n, n - 1, n - 2],
        "before_seq pages newest first"
    );

    // Archive: agents closed, directory gone, branch kept.
    let archived = app
        .post_ok(
            &format!("/v1/workspaces/{}/archive", ws["id"].as_str().unwrap()),
            json!({}),
            200,
        )
        .await;
    assert_eq!(archived["status"], "archived");
    assert!(!wpath.exists(), "the worktree directory is removed");
    assert!(
        git(repo.path(), &["branch", "--list", "agentry/ci-run"]).contains("agentry/ci-run"),
        "the branch is kept"
    );
    let agent = app.get_ok(&format!("/v1/agents/{id}")).await;
    assert_eq!(agent["status"], "closed");
    assert!(agent["runtime"]["pid"].is_null());
    app.stop().await;
}
