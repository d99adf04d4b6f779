//! Scenarios every real-CLI suite runs the same way, written once. A suite implements
//! [`Rig`] for its world — how to open an agent, how to script its fake model, how to
//! recognise the processes started for the test — and calls a scenario from its own
//! `#[tokio::test]`.

use std::any::Any;
use std::future::Future;
use std::time::{Duration, Instant};

use crate::helpers::*;

pub trait Rig: Sized {
    /// How long a turn of this CLI may take.
    const PATIENCE: Duration;

    fn app(&self) -> &TestApp;
    /// A new agent (in a new workspace) in a mode that asks before acting: its id.
    fn agent(&self) -> impl Future<Output = String>;
    /// Script the next model reply: text streamed slowly (seconds), to be cut midway.
    fn reply_slowly(&self);
    /// Script the next model reply: one that never ends.
    fn reply_stalled(&self);
    fn reply_text(&self, text: &str);
    /// `NAME=value` in the environment of every process started for this test (and of
    /// nothing else on the machine).
    fn marker(&self) -> String;
    /// The server, and whatever else must live until it has stopped.
    fn into_app(self) -> (TestApp, Box<dyn Any>);
}

async fn pid_of(app: &TestApp, agent: &str) -> i32 {
    app.get_ok(&format!("/v1/agents/{agent}")).await["runtime"]["pid"]
        .as_i64()
        .expect("a running CLI") as i32
}

async fn ledger_rows(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM managed_processes")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

fn last_message(events: &[SseEvent]) -> String {
    of_kind(events, "assistant_message")
        .last()
        .map(|m| m["text"].as_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// SIGKILL of the CLI mid-turn fails the turn within 2 s, saying so; the next prompt
/// starts the CLI again and completes.
pub async fn a_killed_cli_fails_the_turn_quickly_and_the_agent_recovers(rig: &impl Rig) {
    let app = rig.app();
    let agent = rig.agent().await;
    rig.reply_slowly();
    let mut stream = app.events(&agent, None).await;
    app.prompt(&agent, "talk for a while").await;
    stream.until("assistant_delta", rig_patience(rig)).await;
    let pid = pid_of(app, &agent).await;
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

    rig.reply_text("Recovered.");
    // The session reopens before the prompt is answered, which can take longer than the
    // harness client's 60 s; that also bounds a stream, so it is opened afterwards, from
    // the failed turn's last event.
    app.prompt_within(&agent, "still there?", rig_patience(rig))
        .await;
    let mut stream = app.events(&agent, Some(last_seq(&ended))).await;
    let events = stream.until("turn_completed", rig_patience(rig)).await;
    assert_eq!(
        outcome(&events)["outcome"],
        "completed",
        "{:?}",
        kinds(&events)
    );
    assert_eq!(last_message(&events), "Recovered.");
}

fn rig_patience<R: Rig>(_: &R) -> Duration {
    R::PATIENCE
}

/// Archiving an agent ends its CLI and everything the CLI started, and empties the
/// ledger; so does stopping the server with a turn in flight.
pub async fn no_cli_process_is_left_after_archive_or_server_shutdown(rig: impl Rig) {
    let patience = rig_patience(&rig);
    let marker = rig.marker();
    let app = rig.app();
    let archived = rig.agent().await;
    rig.reply_text("One.");
    let mut stream = app.events(&archived, None).await;
    app.prompt(&archived, "one").await;
    let events = stream.until("turn_completed", patience).await;
    assert_eq!(outcome(&events)["outcome"], "completed");
    let pid = pid_of(app, &archived).await;
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
        ledger_rows(app).await,
        0,
        "the ledger is empty after archive"
    );

    // Server shutdown, with a turn in flight.
    let agent = rig.agent().await;
    rig.reply_stalled();
    let mut stream = app.events(&agent, None).await;
    app.prompt(&agent, "talk").await;
    stream.until("assistant_delta", patience).await;
    let pid = pid_of(app, &agent).await;
    let (app, _keep) = rig.into_app();
    let (db, _data_dir, _token) = app.stop().await;
    assert!(!pid_alive(pid), "the server's stop ended the CLI");
    let left = processes_with_env(&marker);
    assert!(left.is_empty(), "left running: {left:?}");
    let pool = sqlx::PgPool::connect_with(db).await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM managed_processes")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "the ledger is empty after shutdown");
}
