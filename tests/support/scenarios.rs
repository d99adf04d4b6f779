//! Scenarios every real-CLI suite runs the same way, written once. A suite implements
//! [`Rig`] for its provider — what it lists, the mode that asks, how to script its fake
//! model, what else its own turns show — and calls a scenario with its world from its own
//! `#[tokio::test]`.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::cli_world::{CliWorld, Provider, assistant_text, last_message, ledger_rows};
use crate::helpers::*;

pub trait Rig: Provider + Sized {
    /// How long a turn of this CLI may take here.
    const PATIENCE: Duration = Self::TURN;
    /// The protocol the provider is listed with.
    const PROTOCOL: &'static str;
    /// The provider's modes as listed, in order: (id, unattended).
    const MODES: &'static [(&'static str, bool)];
    /// A mode that asks before acting: the scenarios' agents are created in it, and the
    /// text turn's listing has it as the default.
    const ASKING_MODE: &'static str;
    /// A mode that runs every tool without asking.
    const UNATTENDED_MODE: &'static str;
    /// The output tokens the fake model reports for a reply.
    const REPLY_TOKENS: u64;
    /// What the error of a denied call says, when it says why.
    const DENIAL_SAYS: Option<&'static str> = None;

    /// Script the next model reply: `text` streamed in a few pieces, a little apart.
    fn reply_in_pieces(fake: &Self::Fake, text: &str);
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

    /// What else the provider's model catalog shows.
    fn check_models(_models: &Value) {}
    /// What else a text turn shows: its usage, the request the model got.
    fn check_text_turn(
        _w: &CliWorld<Self>,
        _agent: &str,
        _events: &[SseEvent],
    ) -> impl Future<Output = ()> {
        async {}
    }
    /// The answer that allows a write.
    fn allow() -> Value {
        json!({"behavior": "allow"})
    }
    /// What else the permission request of a write shows, with the events before it.
    fn check_write_request(_before: &[SseEvent], _request: &Value) {}
    /// What else an allowed write shows, with the events after the answer.
    fn check_written(_w: &CliWorld<Self>, _after: &[SseEvent], _request: &Value) {}
    /// What else a denied write shows (what the model heard).
    fn check_denied(_w: &CliWorld<Self>) {}
    /// Checks of the data dir while the server is down for a restart.
    fn while_stopped(_data_dir: &Path) {}
}

/// The ids of a permission request's options, in order.
pub fn option_ids(request: &Value) -> Vec<&str> {
    request["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["id"].as_str().unwrap())
        .collect()
}

/// The provider is listed as configured, with its modes and catalog (whose probe leaves no
/// process behind); a text turn streams in deltas, is reported once as the user's message
/// and once as the assistant's, and completes with its usage; the model heard the prompt.
pub async fn a_text_turn_streams_deltas_and_completes_with_usage<R: Rig>(w: &CliWorld<R>) {
    const TEXT: &str = "Hello from the fake model, in pieces.";
    let listed = w.app.provider(R::ID).await;
    assert_eq!(listed["available"], true, "{listed}");
    assert_eq!(listed["protocol"], R::PROTOCOL, "{listed}");
    assert_eq!(listed["default_mode"], R::ASKING_MODE, "{listed}");
    let modes: Vec<(&str, bool)> = listed["modes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["unattended"] == true))
        .collect();
    assert_eq!(modes, R::MODES, "{listed}");
    let models = w
        .app
        .get_ok(&format!("/v1/providers/{}/models", R::ID))
        .await;
    R::check_models(&models);
    assert_eq!(
        ledger_rows(&w.app.pool).await,
        0,
        "the catalog probe leaves no process behind"
    );

    let (agent, _) = w.agent(R::ASKING_MODE).await;
    R::reply_in_pieces(&w.fake, TEXT);
    let events = w.turn(&agent, "say hello", None).await;
    let k = kinds(&events);
    let done = outcome(&events);
    assert_eq!(done["outcome"], "completed", "{k:?}");
    let user = of_kind(&events, "user_message");
    assert_eq!(user.len(), 1, "{k:?}");
    assert_eq!(user[0]["text"], "say hello");
    let deltas: String = of_kind(&events, "assistant_delta")
        .iter()
        .map(|d| d["text"].as_str().unwrap())
        .collect();
    assert!(of_kind(&events, "assistant_delta").len() >= 2, "{k:?}");
    assert_eq!(deltas, TEXT);
    assert_eq!(assistant_text(&events), deltas);
    assert_eq!(done["usage"]["output_tokens"], R::REPLY_TOKENS, "{done}");
    assert!(
        done["usage"]["input_tokens"].as_u64().unwrap() > 0,
        "{done}"
    );
    let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(a["mode"], R::ASKING_MODE, "{a}");
    let heard = R::last_conversation(&w.fake);
    assert!(heard.contains("say hello"), "{heard}");
    R::check_text_turn(w, &agent, &events).await;
}

/// A write in the asking mode waits for its answer, announced and unwritten; allowed, it
/// lands in the worktree and its diff, and the turn completes.
pub async fn an_approved_write_lands_in_the_worktree_and_its_diff<R: Rig>(w: &CliWorld<R>) {
    let app = &w.app;
    let (agent, ws) = w.agent(R::ASKING_MODE).await;
    let path = path_of(&ws["path"]).join("hello.txt");
    let content = format!("hello from {}\n", R::ID);
    R::reply_write(&w.fake, &path, &content);
    R::reply_text(&w.fake, "The file is written.");

    let mut stream = app.events(&agent, None).await;
    app.prompt(&agent, "write hello.txt").await;
    let before = stream.until("permission_requested", R::PATIENCE).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    assert_eq!(request["kind"], "tool", "{request}");
    // agentry's option ids, not the CLI's.
    let options = option_ids(&request);
    assert!(options.contains(&"allow"), "{request}");
    assert!(options.contains(&"deny"), "{request}");
    assert!(
        !of_kind(&before, "tool_call").is_empty(),
        "the call is announced: {:?}",
        kinds(&before)
    );
    assert!(!path.exists(), "nothing is written before the answer");
    R::check_write_request(&before, &request);

    w.answer_with(&agent, &request, R::allow()).await;
    let after = stream.until("turn_completed", R::PATIENCE).await;
    assert_eq!(
        outcome(&after)["outcome"],
        "completed",
        "{:?}",
        kinds(&after)
    );
    let calls = of_kind(&after, "tool_call");
    let done = calls.last().expect("the call's end");
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), content);
    assert_eq!(last_message(&after), "The file is written.");

    let diff = app
        .get_ok(&format!(
            "/v1/workspaces/{}/diff",
            ws["id"].as_str().unwrap()
        ))
        .await;
    assert!(
        diff["files"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["path"] == "hello.txt"),
        "{diff}"
    );
    let added = format!("+{}", content.trim_end());
    assert!(diff["patch"].as_str().unwrap().contains(&added), "{diff}");
    R::check_written(w, &after, &request);
}

/// In the unattended mode a write runs without asking; returns the agent, its workspace
/// and the turn's events, for a suite to go on from.
pub async fn the_unattended_mode_writes_without_asking<R: Rig>(
    w: &CliWorld<R>,
) -> (String, Value, Vec<SseEvent>) {
    let (agent, ws) = w.agent(R::UNATTENDED_MODE).await;
    let path = path_of(&ws["path"]).join("unattended.txt");
    R::reply_write(&w.fake, &path, "unattended\n");
    R::reply_text(&w.fake, "Done without asking.");
    let events = w.turn(&agent, "write unattended.txt", None).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    let calls = of_kind(&events, "tool_call");
    let done = calls.last().unwrap_or_else(|| panic!("{k:?}"));
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "unattended\n");
    let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(a["mode"], R::UNATTENDED_MODE, "{a}");
    (agent, ws, events)
}

/// A switch to the unattended mode in a live session is reported once and stops the
/// asking in the same process; returns the agent, its workspace and the turn's events, for
/// a suite to go on from.
pub async fn a_live_switch_to_the_unattended_mode_stops_the_asking<R: Rig>(
    w: &CliWorld<R>,
) -> (String, Value, Vec<SseEvent>) {
    let app = &w.app;
    let (agent, ws) = w.agent(R::ASKING_MODE).await;
    R::reply_text(&w.fake, "Ready.");
    let first = w.turn(&agent, "get ready", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    let pid = w.pid(&agent).await;

    let mut stream = app.events(&agent, Some(last_seq(&first))).await;
    let changed = app
        .put_ok(
            &format!("/v1/agents/{agent}/mode"),
            json!({"mode": R::UNATTENDED_MODE}),
        )
        .await;
    assert_eq!(changed["mode"], R::UNATTENDED_MODE, "{changed}");
    let path = path_of(&ws["path"]).join("switched.txt");
    R::reply_write(&w.fake, &path, "switched\n");
    R::reply_text(&w.fake, "Wrote it.");
    app.prompt(&agent, "write switched.txt").await;
    let events = stream.until("turn_completed", R::PATIENCE).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    let modes = of_kind(&events, "mode_changed");
    assert_eq!(modes.len(), 1, "{k:?}");
    assert_eq!(modes[0]["mode"], R::UNATTENDED_MODE);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "switched\n");
    assert_eq!(w.pid(&agent).await, pid, "the same process, not a restart");
    (agent, ws, events)
}

/// A denied write fails its call, writes nothing and completes the turn; the agent goes on.
pub async fn a_denied_write_fails_its_call_and_the_agent_goes_on<R: Rig>(w: &CliWorld<R>) {
    let app = &w.app;
    let (agent, ws) = w.agent(R::ASKING_MODE).await;
    let path = path_of(&ws["path"]).join("denied.txt");
    // Whatever the CLI asks the model after the refusal is answered "Done.".
    R::reply_write(&w.fake, &path, "no\n");
    let mut stream = app.events(&agent, None).await;
    app.prompt(&agent, "make denied.txt").await;
    let before = stream.until("permission_requested", R::PATIENCE).await;
    let request = of_kind(&before, "permission_requested")[0].clone();
    w.answer(&agent, &request, "deny").await;
    let after = stream.until("turn_completed", R::PATIENCE).await;
    let k = kinds(&after);
    assert_eq!(outcome(&after)["outcome"], "completed", "{k:?}");
    let calls = of_kind(&after, "tool_call");
    let failed = calls
        .last()
        .unwrap_or_else(|| panic!("the call's end: {k:?}"));
    assert_eq!(failed["call_id"], request["call_id"], "{failed}");
    assert_eq!(failed["status"], "failed", "{failed}");
    if let Some(says) = R::DENIAL_SAYS {
        let error = failed["error"].as_str().unwrap_or_default();
        assert!(error.contains(says), "{failed}");
    }
    R::check_denied(w);
    assert!(!path.exists());
    let resolved = of_kind(&after, "permission_resolved");
    assert_eq!(resolved[0]["behavior"], "deny", "{k:?}");

    R::reply_text(&w.fake, "Fine.");
    let next = w.turn(&agent, "never mind", Some(last_seq(&after))).await;
    assert_eq!(outcome(&next)["outcome"], "completed", "{:?}", kinds(&next));
    assert_eq!(last_message(&next), "Fine.");
}

/// A server restart ends the CLI of an agent in the unattended mode; its next prompt
/// reopens the same session in that mode (not reported as a change): a write runs without
/// asking, and the model hears the earlier turn.
pub async fn after_a_server_restart_the_agent_resumes_in_its_mode<R: Rig>(w: CliWorld<R>) {
    let (agent, ws) = w.agent(R::UNATTENDED_MODE).await;
    R::reply_text(&w.fake, "Noted: mango.");
    let first = w.turn(&agent, "remember mango", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");
    let id = w.session_id(&agent).await;
    let pid = w.pid(&agent).await;

    let w = w
        .restart(|data_dir| {
            assert!(!pid_alive(pid), "the server's stop ended the CLI");
            R::while_stopped(data_dir);
        })
        .await;

    let path = path_of(&ws["path"]).join("after.txt");
    R::reply_write(&w.fake, &path, "after\n");
    R::reply_text(&w.fake, "You said mango.");
    let mut stream = w.app.events(&agent, Some(last_seq(&first))).await;
    w.app
        .prompt(&agent, "what fruit? and write after.txt")
        .await;
    let second = stream.until("turn_completed", R::PATIENCE).await;
    let k = kinds(&second);
    assert_eq!(outcome(&second)["outcome"], "completed", "{k:?}");
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    let started = of_kind(&second, "session_started");
    let started = started.last().unwrap_or_else(|| panic!("{k:?}"));
    assert_eq!(started["resumed"], true, "{started}");
    assert_eq!(started["provider_session_id"], id.as_str(), "{started}");
    assert!(of_kind(&second, "mode_changed").is_empty(), "{k:?}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "after\n");
    let a = w.app.get_ok(&format!("/v1/agents/{agent}")).await;
    assert_eq!(a["mode"], R::UNATTENDED_MODE, "{a}");
    assert_eq!(w.session_id(&agent).await, id);
    let history = R::last_conversation(&w.fake);
    assert!(history.contains("remember mango"), "{history}");
    assert!(history.contains("Noted: mango."), "{history}");
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

    let closed = app
        .post_ok(&format!("/v1/agents/{agent}/close"), json!({}), 200)
        .await;
    assert_eq!(closed["status"], "closed", "{closed}");
    eventually("the CLI to end", Duration::from_secs(10), || {
        !pid_alive(pid)
    })
    .await;
    R::reply_text(&w.fake, "It was pineapple.");
    // The prompt is answered once its turn starts, after the session is reopened (for
    // some CLIs a wait of its own), which can take longer than the harness client's 60 s;
    // that also bounds a stream, so it is opened afterwards, from the first turn's last
    // event.
    app.prompt_within(
        &agent,
        "what was the word?",
        R::PATIENCE + Duration::from_secs(30),
    )
    .await;
    let mut stream = app.events(&agent, Some(last_seq(&first))).await;
    let second = stream.until("turn_completed", R::PATIENCE).await;
    let k = kinds(&second);
    assert_eq!(outcome(&second)["outcome"], "completed", "{k:?}");
    let errors = of_kind(&second, "error");
    assert!(errors.is_empty(), "{errors:?}");
    let started = of_kind(&second, "session_started");
    assert_eq!(started.len(), 1, "{k:?}");
    assert_eq!(started[0]["resumed"], true);
    assert_eq!(started[0]["provider_session_id"], id.as_str());
    assert_eq!(of_kind(&second, "user_message").len(), 1, "{k:?}");
    assert_eq!(of_kind(&second, "assistant_message").len(), 1, "{k:?}");
    assert_eq!(assistant_text(&second), "It was pineapple.");
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
    let after = app.wait(&agent).await;
    assert_eq!(after["status"], "error", "{after}");

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

/// Archiving an agent ends its CLI and everything the CLI started, empties the ledger and
/// removes the CLI's own TMPDIR; so does stopping the server with a turn in flight.
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
    assert_eq!(ledger_rows(&app.pool).await, 1, "the CLI is in the ledger");
    let res = app.delete(&format!("/v1/agents/{archived}")).await;
    assert_eq!(res.status(), 204);
    eventually(
        "the archived agent's CLI to end",
        Duration::from_secs(10),
        || !pid_alive(pid),
    )
    .await;
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
    // Some CLIs (OpenCode) unpack files into TMPDIR at every start and never remove them:
    // the process's own TMPDIR goes with it.
    let tmp_left: Vec<_> = std::fs::read_dir(app.data_dir.path().join("tmp"))
        .map(|dir| dir.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(tmp_left.is_empty(), "no TMPDIR is left: {tmp_left:?}");

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

/// A provider with a mode that edits files without asking, and a second model.
pub trait LiveChanges: Rig {
    /// A mode that edits files without asking (and asks before other commands).
    const EDITS_MODE: &'static str;
    /// A model other than the agent's.
    const OTHER_MODEL: &'static str;
    /// The model's last request asked for `OTHER_MODEL`; `changed` is the event that said
    /// so.
    fn check_other_model_asked(fake: &Self::Fake, changed: &Value);
}

/// A mode and a model changed in a live session are reported once each and reach the
/// CLI: the next write needs no approval, and the model is asked as the one chosen.
pub async fn mode_and_model_change_in_a_live_session<R: LiveChanges>(w: &CliWorld<R>) {
    let app = &w.app;
    let (agent, ws) = w.agent(R::ASKING_MODE).await;
    R::reply_text(&w.fake, "Ready.");
    let first = w.turn(&agent, "get ready", None).await;
    assert_eq!(outcome(&first)["outcome"], "completed");

    let mut stream = app.events(&agent, Some(last_seq(&first))).await;
    let changed = app
        .put_ok(
            &format!("/v1/agents/{agent}/mode"),
            json!({"mode": R::EDITS_MODE}),
        )
        .await;
    assert_eq!(changed["mode"], R::EDITS_MODE, "{changed}");
    let changed = app
        .put_ok(
            &format!("/v1/agents/{agent}/model"),
            json!({"model": R::OTHER_MODEL}),
        )
        .await;
    assert_eq!(changed["model"], R::OTHER_MODEL, "{changed}");

    let path = path_of(&ws["path"]).join("edited.txt");
    R::reply_write(&w.fake, &path, "accepted\n");
    R::reply_text(&w.fake, "Wrote it.");
    app.prompt(&agent, "write edited.txt").await;
    let events = stream.until("turn_completed", R::PATIENCE).await;
    let k = kinds(&events);
    assert_eq!(outcome(&events)["outcome"], "completed", "{k:?}");
    let modes = of_kind(&events, "mode_changed");
    assert_eq!(modes.len(), 1, "{k:?}");
    assert_eq!(modes[0]["mode"], R::EDITS_MODE, "{k:?}");
    let models = of_kind(&events, "model_changed");
    assert_eq!(models.len(), 1, "{k:?}");
    assert!(!k.contains(&"permission_requested"), "{k:?}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "accepted\n");
    R::check_other_model_asked(&w.fake, models[0]);
}
