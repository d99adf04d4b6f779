//! Scenarios every real-CLI suite runs the same way, written once. A suite implements
//! [`Rig`] for its provider — the mode that asks, how to script its fake model — and
//! calls a scenario with its world from its own `#[tokio::test]`.

use std::time::{Duration, Instant};

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
