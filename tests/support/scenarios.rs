//! Scenarios every real-CLI suite runs the same way, written once. A suite implements
//! [`Rig`] for its provider — the mode that asks, how to script its fake model — and
//! calls a scenario with its world from its own `#[tokio::test]`.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::cli_world::{CliWorld, Provider, last_message, ledger_rows};
use crate::helpers::*;

pub trait Rig: Provider {
    /// How long a turn of this CLI may take here.
    const PATIENCE: Duration = Self::TURN;
    /// A mode that asks before acting: the scenarios' agents are created in it.
    const ASKING_MODE: &'static str;

    /// Script the next model reply: text streamed slowly (seconds), to be cut midway.
    fn reply_slowly(fake: &Self::Fake);
    /// Script the next model reply: one that never ends.
    fn reply_stalled(fake: &Self::Fake);
    fn reply_text(fake: &Self::Fake, text: &str);
    /// Script the next model reply: a call of the CLI's own tool that writes `content` to
    /// `path`, which the asking mode asks about.
    fn reply_write(fake: &Self::Fake, path: &Path, content: &str);
    /// The conversation the model was sent last, as text.
    fn last_conversation(fake: &Self::Fake) -> String;
}

/// An interrupt mid-answer cancels the turn; the next prompt completes.
pub async fn an_interrupted_turn_is_canceled_and_the_next_prompt_works<R: Rig>(w: &CliWorld<R>) {
    let app = &w.app;
    let (agent, _) = w.agent(R::ASKING_MODE).await;
    R::reply_slowly(&w.fake);
    let mut stream = app.events(&agent, None).await;
    app.prompt(&agent, "talk slowly").await;
    stream.until("assistant_delta", R::PATIENCE).await;
    app.post_ok(&format!("/v1/agents/{agent}/interrupt"), json!({}), 202)
        .await;
    let ended = stream.until("turn_completed", R::PATIENCE).await;
    let k = kinds(&ended);
    assert_eq!(outcome(&ended)["outcome"], "canceled", "{k:?}");

    R::reply_text(&w.fake, "Back again.");
    let events = w
        .turn(&agent, "are you there?", Some(last_seq(&ended)))
        .await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert_eq!(last_message(&events), "Back again.");
}

/// An interrupt while a permission request waits cancels the turn: the call the CLI
/// never closed is failed, the request expires and no answer reaches it any more, and
/// nothing is written; the next prompt completes.
pub async fn an_interrupt_while_a_permission_is_pending_cancels_the_turn<R: Rig>(w: &CliWorld<R>) {
    let app = &w.app;
    let (agent, ws) = w.agent(R::ASKING_MODE).await;
    let path = path_of(&ws["path"]).join("never.txt");
    R::reply_write(&w.fake, &path, "never\n");
    let mut stream = app.events(&agent, None).await;
    app.prompt(&agent, "write never.txt").await;
    let before = stream.until("permission_requested", R::PATIENCE).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    app.post_ok(&format!("/v1/agents/{agent}/interrupt"), json!({}), 202)
        .await;
    let ended = stream.until("turn_completed", R::PATIENCE).await;
    let k = kinds(&ended);
    assert_eq!(outcome(&ended)["outcome"], "canceled", "{k:?}");
    let calls = of_kind(&ended, "tool_call");
    assert_eq!(calls.last().unwrap()["status"], "failed", "{k:?}");
    let a = app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(a["pending_permissions"], 0, "{a}");
    assert!(!path.exists());
    let late = app
        .post(
            &format!(
                "/v1/agents/{agent}/permissions/{}",
                request["request_id"].as_str().unwrap()
            ),
            json!({"behavior": "allow"}),
        )
        .await;
    assert!(late.status().is_client_error(), "{}", late.status());

    R::reply_text(&w.fake, "Back.");
    let next = w.turn(&agent, "hello again", Some(last_seq(&ended))).await;
    assert_eq!(outcome(&next)["outcome"], "completed", "{:?}", kinds(&next));
    assert_eq!(last_message(&next), "Back.");
    assert!(!path.exists());
}

/// A closed agent's next prompt starts its CLI again on the same session: the model hears
/// the whole conversation, and the history the CLI replays is not reported again.
pub async fn a_closed_agent_resumes_its_conversation<R: Rig>(w: &CliWorld<R>) {
    let app = &w.app;
    let (agent, _) = w.agent(R::ASKING_MODE).await;
    R::reply_text(&w.fake, "I will remember pineapple.");
    let first = w.turn(&agent, "the secret word is pineapple", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    let id = w.session_id(&agent).await;
    let pid = w.pid(&agent).await;

    app.post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    eventually("the CLI to end", Duration::from_secs(10), || {
        !pid_alive(pid)
    })
    .await;
    R::reply_text(&w.fake, "It was pineapple.");
    let second = w
        .turn(&agent, "what was the word?", Some(last_seq(&first)))
        .await;
    let k = kinds(&second);
    assert_eq!(outcome(&second)["outcome"], "completed", "{k:?}");
    let started = of_kind(&second, "session_started");
    assert_eq!(started.len(), 1, "{k:?}");
    assert_eq!(started[0]["resumed"], true);
    assert_eq!(started[0]["provider_session_id"], id.as_str());
    assert_eq!(of_kind(&second, "assistant_message").len(), 1, "{k:?}");
    assert_eq!(last_message(&second), "It was pineapple.");
    let history = R::last_conversation(&w.fake);
    assert!(
        history.contains("the secret word is pineapple"),
        "{history}"
    );
    assert!(history.contains("I will remember pineapple."), "{history}");
    assert!(history.contains("what was the word?"), "{history}");
}

/// SIGKILL of the CLI mid-turn fails the turn within 2 s, saying so; the next prompt
/// starts the CLI again and completes.
pub async fn a_killed_cli_fails_the_turn_quickly_and_the_agent_recovers<R: Rig>(w: &CliWorld<R>) {
    let app = &w.app;
    let (agent, _) = w.agent(R::ASKING_MODE).await;
    R::reply_slowly(&w.fake);
    let mut stream = app.events(&agent, None).await;
    app.prompt(&agent, "talk for a while").await;
    stream.until("assistant_delta", R::PATIENCE).await;
    let pid = w.pid(&agent).await;
    let killed = Instant::now();
    // SAFETY: kill(2) on the CLI process this test's server started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let ended = stream.until("turn_completed", Duration::from_secs(5)).await;
    let took = killed.elapsed();
    eprintln!("the turn failed {took:?} after SIGKILL");
    let done = outcome(&ended);
    assert_eq!(done["outcome"], "failed", "{done}");
    assert!(
        took < Duration::from_secs(2),
        "the turn failed after {took:?}"
    );
    assert!(
        done["error"].as_str().unwrap().contains("signal 9"),
        "{done}"
    );

    R::reply_text(&w.fake, "Recovered.");
    // The session reopens before the prompt is answered, which can take longer than the
    // harness client's 60 s; that also bounds a stream, so it is opened afterwards, from
    // the failed turn's last event.
    app.prompt_within(&agent, "still there?", R::PATIENCE).await;
    let mut stream = app.events(&agent, Some(last_seq(&ended))).await;
    let events = stream.until("turn_completed", R::PATIENCE).await;
    assert_eq!(
        outcome(&events)["outcome"],
        "completed",
        "{:?}",
        kinds(&events)
    );
    assert_eq!(last_message(&events), "Recovered.");
}

/// Archiving an agent ends its CLI and everything the CLI started, and empties the
/// ledger; so does stopping the server with a turn in flight.
pub async fn no_cli_process_is_left_after_archive_or_server_shutdown<R: Rig>(w: CliWorld<R>) {
    let marker = w.marker();
    let app = &w.app;
    let (archived, _) = w.agent(R::ASKING_MODE).await;
    R::reply_text(&w.fake, "One.");
    let mut stream = app.events(&archived, None).await;
    app.prompt(&archived, "one").await;
    let events = stream.until("turn_completed", R::PATIENCE).await;
    assert_eq!(outcome(&events)["outcome"], "completed");
    let pid = w.pid(&archived).await;
    assert!(
        processes_with_env(&marker).contains(&pid),
        "the CLI is found by its environment"
    );
    let res = app.delete(&format!("/v1/agents/{archived}")).await;
    assert_eq!(res.status(), 204);
    eventually(
        "the archived agent's processes to end",
        Duration::from_secs(10),
        || processes_with_env(&marker).is_empty(),
    )
    .await;
    assert_eq!(
        ledger_rows(&app.pool).await,
        0,
        "the ledger is empty after archive"
    );

    // Server shutdown, with a turn in flight.
    let (agent, _) = w.agent(R::ASKING_MODE).await;
    R::reply_stalled(&w.fake);
    let mut stream = app.events(&agent, None).await;
    app.prompt(&agent, "talk").await;
    stream.until("assistant_delta", R::PATIENCE).await;
    let pid = w.pid(&agent).await;
    let (app, _rest) = w.into_app();
    let (db, _data_dir, _token) = app.stop().await;
    assert!(!pid_alive(pid), "the server's stop ended the CLI");
    let left = processes_with_env(&marker);
    assert!(left.is_empty(), "left running: {left:?}");
    let pool = sqlx::PgPool::connect_with(db).await.unwrap();
    assert_eq!(
        ledger_rows(&pool).await,
        0,
        "the ledger is empty after shutdown"
    );
}
