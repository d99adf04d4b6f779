//! The event writer against bad data (an event the database refuses among busy agents,
//! provider output carrying U+0000), beside a slow commit, and how long it batches.

use std::time::Duration;

use agentry::config::Settings;
use agentry::domain::{AgentId, EventKind, NewEvent};
use serde_json::{Value, json};

use crate::helpers::*;

/// Text the test database refuses to store in an event (a CHECK constraint added to this
/// test's own database: the database itself says no).
const POISON: &str = "POISON-7f3a";

/// Check one agent's timeline: seq 1..N dense, its `/load` turn complete, every delta
/// there and the deltas adding up to the message.
fn assert_load_timeline(events: &[Value], chunks: usize) {
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    let expected: Vec<i64> = (1..=events.len() as i64).collect();
    assert_eq!(seqs, expected, "seq is dense from 1");
    let deltas: Vec<&str> = events
        .iter()
        .filter(|e| e["kind"] == "assistant_delta")
        .map(|e| e["data"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(deltas.len(), chunks, "every chunk committed");
    let message = events
        .iter()
        .find(|e| e["kind"] == "assistant_message")
        .expect("the closing message");
    assert_eq!(deltas.concat(), message["data"]["text"].as_str().unwrap());
    let done = events
        .iter()
        .rfind(|e| e["kind"] == "turn_completed")
        .expect("the turn ended");
    assert_eq!(done["data"]["outcome"], "completed");
    assert!(
        events.iter().all(|e| e["kind"] != "error"),
        "bystanders have no error events"
    );
}

/// An assistant text chunk of `agent`, as a provider would hand it to the writer.
fn delta(agent: AgentId, text: &str) -> NewEvent {
    NewEvent {
        agent_id: agent,
        turn_id: None,
        kind: EventKind::AssistantDelta,
        data: json!({"message_id": "m", "text": text}),
    }
}

/// A server with `tweak`ed settings and `n` open mock agents, each in a workspace of its
/// own; the repository lives as long as the returned guard.
async fn app_with_agents(
    tweak: impl FnOnce(&mut Settings),
    n: usize,
) -> (TestApp, tempfile::TempDir, Vec<AgentId>) {
    let app = spawn_app_with(tweak).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let agent = app.agent_in_new_workspace(&project, "mock").await;
        ids.push(agent.parse().unwrap());
    }
    (app, repo, ids)
}

/// Commit one event of `agent` with the state change it announces, on a task of its own.
fn with_status(
    writer: &agentry::events::EventWriter,
    agent: AgentId,
    text: &str,
) -> tokio::task::JoinHandle<Result<Vec<agentry::domain::AgentEvent>, agentry::events::WriteError>>
{
    use agentry::domain::AgentStatus;
    use agentry::events::{Attached, StateChange};
    let writer = writer.clone();
    let events = vec![delta(agent, text)];
    tokio::spawn(async move {
        writer
            .append_committed_with(
                events,
                Attached {
                    changes: vec![StateChange::Status {
                        agent,
                        status: AgentStatus::Idle,
                        reason: None,
                    }],
                    ..Attached::default()
                },
            )
            .await
    })
}

/// The database refuses any event whose text carries the marker (the test's own database).
async fn refuse_poison(app: &TestApp) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE agent_events ADD CONSTRAINT poison_marker
         CHECK (strpos(coalesce(data->>'text', ''), '{POISON}') = 0)"
    )))
    .execute(&app.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_refused_event_becomes_an_error_in_its_slot_and_stalls_nobody() {
    let app = spawn_app().await;
    refuse_poison(&app).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let mut bystanders = Vec::new();
    for _ in 0..4 {
        bystanders.push(app.agent_in_new_workspace(&project, "mock").await);
    }
    let victim = app.agent_in_new_workspace(&project, "mock").await;
    // Team events are refused the same way: the victim's `running` activity.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE team_events ADD CONSTRAINT poison_activity
         CHECK (NOT (kind = 'agent_status' AND data->>'status' = 'running'
                     AND data->>'agent_id' = '{victim}'))"
    )))
    .execute(&app.pool)
    .await
    .unwrap();
    let before = app.writer.stats();

    // Paced load (about 1,000 events/s per agent): the writer keeps up easily, so any
    // long wait in the queue would be the refused event's doing.
    const CHUNKS: usize = 1500;
    for b in &bystanders {
        app.prompt(b, &format!("/load {CHUNKS} 1")).await;
    }
    let mut poisoned_turns = Vec::new();
    for i in 0..3 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        poisoned_turns.push(app.prompt(&victim, &format!("{POISON} number {i}")).await);
        let w = app.wait(&victim).await;
        assert_eq!(w["last_turn"]["outcome"], "completed", "{w}");
    }
    for b in &bystanders {
        let w = app.wait(b).await;
        assert_eq!(w["status"], "idle", "{w}");
        assert_eq!(w["last_turn"]["outcome"], "completed", "{w}");
    }

    for b in &bystanders {
        assert_load_timeline(&app.timeline(b).await, CHUNKS);
    }

    // The victim: each user message's slot holds the error, the turn went on around it.
    let events = app.timeline(&victim).await;
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>());
    assert!(
        events.iter().all(|e| e["kind"] != "user_message"),
        "every prompt carried the marker"
    );
    for turn in &poisoned_turns {
        let in_turn: Vec<&Value> = events.iter().filter(|e| e["turn_id"] == *turn).collect();
        assert_eq!(in_turn[0]["kind"], "turn_started");
        let slot = in_turn[1];
        assert_eq!(slot["kind"], "error", "{slot}");
        assert_eq!(slot["data"]["code"], "event_rejected");
        let message = slot["data"]["message"].as_str().unwrap();
        assert!(message.contains("user_message"), "{message}");
        assert!(
            !message.contains(POISON),
            "the refused data is not repeated"
        );
        assert_eq!(in_turn.last().unwrap()["kind"], "turn_completed");
    }
    let rejected_in_timeline = events
        .iter()
        .filter(|e| e["kind"] == "error" && e["data"]["code"] == "event_rejected")
        .count() as u64;

    let after = app.writer.stats();
    assert_eq!(
        after.rejected_events - before.rejected_events,
        rejected_in_timeline
    );
    assert_eq!(
        after.rejected_team_events - before.rejected_team_events,
        poisoned_turns.len() as u64,
        "one refused `running` activity per turn"
    );
    // The team events around the refused ones are stored.
    let (idle,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM team_events
         WHERE kind = 'agent_status' AND data->>'agent_id' = $1 AND data->>'status' = 'idle'",
    )
    .bind(&victim)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(
        idle as usize > poisoned_turns.len(),
        "{idle} idle activities"
    );
    eprintln!(
        "isolating refused events took at most {:?}; longest queue wait {:?}",
        after.max_isolation, after.max_queue_wait
    );
    assert!(after.max_isolation > Duration::ZERO, "a batch was refused");
    // How long isolation takes is a figure for `agentry bench`, not for a test on a shared
    // machine; what must never happen is a stall: the writer waiting out a statement
    // deadline (5 s) or backing off as if the store were down.
    assert!(
        after.max_isolation < Duration::from_secs(5),
        "setting the refused events aside delayed the others by {:?}",
        after.max_isolation
    );
    assert_eq!(after.queued_events, 0);
    app.stop().await;
}

/// A scripted ACP agent whose output carries U+0000 in a tool title, a tool input key,
/// tool output and message text, then says something more.
const NUL_AGENT: &str = r#"
emit() { printf '%s\n' "$1"; }
upd() { emit "{\"jsonrpc\":\"2.0\",\"method\":\"session/update\",\"params\":{\"sessionId\":\"s1\",\"update\":$1}}"; }
while IFS= read -r line; do
  id=$(printf '%s' "$line" | sed -n -e 's/.*"id":\([0-9][0-9]*\).*/\1/p' -e 's/.*"id":\("[^"]*"\).*/\1/p')
  case "$line" in
  *'"method":"initialize"'*)
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{\"protocolVersion\":1,\"agentCapabilities\":{}}}" ;;
  *'"method":"session/new"'*)
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{\"sessionId\":\"s1\"}}" ;;
  *'"method":"session/prompt"'*)
    upd '{"sessionUpdate":"tool_call","toolCallId":"t1","title":"cat a\u0000b","kind":"execute","status":"in_progress","rawInput":{"k\u0000":"v"}}'
    upd '{"sessionUpdate":"tool_call_update","toolCallId":"t1","status":"completed","rawOutput":{"stdout":"x\u0000y"}}'
    upd '{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"a\u0000b"}}'
    upd '{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":" and later"}}'
    emit "{\"jsonrpc\":\"2.0\",\"id\":$id,\"result\":{\"stopReason\":\"end_turn\"}}" ;;
  esac
done
"#;

#[tokio::test]
async fn provider_nul_is_stored_and_streamed_as_the_replacement_character() {
    let app = spawn_app_with(|s| {
        s.providers.insert(
            "nul".into(),
            agentry::config::ProviderSettings {
                extends: Some("acp".into()),
                command: Some(vec!["sh".into(), "-c".into(), NUL_AGENT.into()]),
                ..Default::default()
            },
        );
    })
    .await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let id = app.agent_in_new_workspace(&project, "nul").await;
    let mut sse = app.events(&id, None).await;
    app.prompt(&id, "print the binary file").await;
    let w = app.wait(&id).await;
    assert_eq!(w["last_turn"]["outcome"], "completed", "{w}");

    let streamed = sse.until("turn_completed", Duration::from_secs(20)).await;
    let stored = app.timeline(&id).await;
    let ids: Vec<i64> = streamed.iter().map(|e| e.id).collect();
    assert_eq!(ids, (1..=streamed.len() as i64).collect::<Vec<_>>());
    for s in &streamed {
        assert_eq!(
            s.data,
            stored[(s.id - 1) as usize],
            "SSE and timeline agree"
        );
    }
    assert!(
        streamed
            .iter()
            .any(|e| e.data["data"]["text"] == "a\u{FFFD}b and later"),
        "SSE streams the replacement character"
    );
    let all = serde_json::to_string(&stored).unwrap();
    assert!(!all.contains("\\u0000"), "no NUL anywhere: {all}");

    let tools: Vec<&Value> = stored.iter().filter(|e| e["kind"] == "tool_call").collect();
    assert!(!tools.is_empty(), "{all}");
    assert_eq!(tools[0]["data"]["title"], "cat a\u{FFFD}b");
    assert_eq!(tools[0]["data"]["input"], json!({"k\u{FFFD}": "v"}));
    let done = tools.last().unwrap();
    assert_eq!(done["data"]["status"], "completed");
    assert!(
        done["data"]["output"].to_string().contains("x\u{FFFD}y"),
        "{done}"
    );
    let message = stored
        .iter()
        .find(|e| e["kind"] == "assistant_message")
        .expect("the message after the NUL is there");
    assert_eq!(message["data"]["text"], "a\u{FFFD}b and later");
    assert!(stored.iter().any(|e| e["kind"] == "turn_completed"));
    assert_eq!(app.writer.stats().rejected_events, 0, "nothing was refused");
    app.stop().await;
}

#[tokio::test]
async fn a_large_batch_over_several_agents_keeps_each_timeline_dense_around_a_refused_event() {
    let app = spawn_app().await;
    refuse_poison(&app).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let mut agents = Vec::new();
    for _ in 0..3 {
        agents.push(app.agent_in_new_workspace(&project, "mock").await);
    }
    let mut before = Vec::new();
    for a in &agents {
        before.push(
            app.get_ok(&format!("/v1/agents/{a}")).await["last_seq"]
                .as_i64()
                .unwrap(),
        );
    }
    // One operation, so one batch of 600 events, agents interleaved, one refused event
    // in the middle of the second agent's. `last_seq` must follow each timeline.
    const PER_AGENT: usize = 200;
    let ids: Vec<AgentId> = agents.iter().map(|a| a.parse().unwrap()).collect();
    let mut events = Vec::new();
    for i in 0..PER_AGENT {
        for (n, id) in ids.iter().enumerate() {
            let text = if n == 1 && i == PER_AGENT / 2 {
                format!("{POISON} {i}")
            } else {
                format!("{n}:{i}")
            };
            events.push(delta(*id, &text));
        }
    }
    let committed = app
        .writer
        .append_committed(events, Vec::new())
        .await
        .unwrap();
    assert_eq!(committed.len(), PER_AGENT * ids.len());

    for (n, a) in agents.iter().enumerate() {
        let view = app.get_ok(&format!("/v1/agents/{a}")).await;
        let last = view["last_seq"].as_i64().unwrap();
        assert_eq!(last, before[n] + PER_AGENT as i64, "{view}");
        let events = app.timeline(a).await;
        let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
        assert_eq!(seqs, (1..=last).collect::<Vec<_>>(), "dense");
        let added = &events[before[n] as usize..];
        for (i, e) in added.iter().enumerate() {
            if n == 1 && i == PER_AGENT / 2 {
                assert_eq!(e["kind"], "error", "{e}");
                assert_eq!(e["data"]["code"], "event_rejected");
            } else {
                assert_eq!(e["data"]["text"], format!("{n}:{i}"), "in order");
            }
        }
    }
    assert_eq!(app.writer.stats().queued_events, 0);
    app.stop().await;
}

/// A moment is stored with its event, in its transaction: also when the event is refused
/// (its stand-in takes the slot and the moment keeps that seq), while a moment the
/// database refuses itself is left out and its event kept. A hook listens for them, or
/// none would be stored; a trigger of the test's own database copies every stored moment
/// aside, since the hooks service consumes them.
#[tokio::test]
async fn moments_go_with_their_events_even_when_an_event_is_refused() {
    use agentry::events::{Attached, NewMoment};

    let app = spawn_app().await;
    refuse_poison(&app).await;
    for sql in [
        "CREATE TABLE moments_seen (agent_id uuid, seq bigint, kind text, payload jsonb)",
        "CREATE FUNCTION copy_moment() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO moments_seen VALUES (NEW.agent_id, NEW.seq, NEW.kind, NEW.payload); RETURN NEW; END $$",
        "CREATE TRIGGER copy_moment AFTER INSERT ON agent_moments FOR EACH ROW EXECUTE FUNCTION copy_moment()",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&app.pool)
            .await
            .unwrap();
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE agent_moments ADD CONSTRAINT poison_moment
         CHECK (strpos(coalesce(payload->>'note', ''), '{POISON}') = 0)"
    )))
    .execute(&app.pool)
    .await
    .unwrap();
    // Moments are stored only while a hook listens for them.
    app.post_ok(
        "/v1/hooks",
        json!({"name": "closes", "events": ["agent.close.after"], "team_id": null,
            "url": "https://hooks.example.com/in", "secret": "whsec_test_0123456789"}),
        201,
    )
    .await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let agent = app.agent_in_new_workspace(&project, "mock").await;
    let id: AgentId = agent.parse().unwrap();
    let last = app.get_ok(&format!("/v1/agents/{agent}")).await["last_seq"]
        .as_i64()
        .unwrap();
    let event = |text: &str| delta(id, text);
    let moment = |event: usize, note: &str| NewMoment {
        event,
        kind: "closed",
        hook: "agent.close.after",
        data: json!({"note": note}),
    };
    let poisoned = format!("{POISON} event");
    let refused_moment = format!("{POISON} moment");
    app.writer
        .append_committed_with(
            vec![event("fine"), event(&poisoned), event("also fine")],
            Attached {
                moments: vec![
                    moment(0, "first"),
                    moment(1, "second"),
                    moment(2, &refused_moment),
                ],
                ..Attached::default()
            },
        )
        .await
        .unwrap();

    let timeline = app.timeline(&agent).await;
    let added = &timeline[last as usize..];
    assert_eq!(added.len(), 3);
    assert_eq!(added[1]["data"]["code"], "event_rejected");
    assert_eq!(
        added[2]["data"]["text"], "also fine",
        "the event outlives its refused moment"
    );
    let seen: Vec<(i64, String)> =
        sqlx::query_as("SELECT seq, payload->>'note' FROM moments_seen WHERE agent_id = $1 AND payload ? 'note' ORDER BY seq")
            .bind(id.uuid())
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        seen,
        vec![
            (last + 1, "first".to_owned()),
            (last + 2, "second".to_owned())
        ]
    );
    app.stop().await;
}

/// What an operation says of its agent's row commits with its events, in order: a turn
/// that starts and ends in one commit keeps its outcome, a late end of an older turn
/// leaves the newer one open, and a refused event beside them changes none of it. Their
/// texts lose U+0000 like event data.
#[tokio::test]
async fn state_changes_commit_with_their_events_in_order_even_beside_a_refused_event() {
    use agentry::domain::{AgentStatus, TurnId, TurnOutcome};
    use agentry::events::{Attached, StateChange};

    let app = spawn_app().await;
    refuse_poison(&app).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let agent = app.agent_in_new_workspace(&project, "mock").await;
    let id: AgentId = agent.parse().unwrap();
    type Row = (
        Option<uuid::Uuid>,
        Option<String>,
        Option<String>,
        String,
        Option<String>,
    );
    let row = || async {
        sqlx::query_as::<_, Row>(
            "SELECT last_turn_id, last_turn_outcome, last_turn_error, status, status_reason
             FROM agents WHERE id = $1",
        )
        .bind(id.uuid())
        .fetch_one(&app.pool)
        .await
        .unwrap()
    };
    let event = |text: &str| delta(id, text);
    let (first, second) = (TurnId::new(), TurnId::new());
    let poisoned = format!("{POISON} event");
    app.writer
        .append_committed_with(
            vec![event("fine"), event(&poisoned)],
            Attached {
                changes: vec![
                    StateChange::TurnStarted {
                        agent: id,
                        turn: first,
                    },
                    StateChange::TurnEnded {
                        agent: id,
                        turn: first,
                        outcome: TurnOutcome::Failed,
                        error: Some("bad\u{0}byte".into()),
                    },
                    StateChange::Status {
                        agent: id,
                        status: AgentStatus::Error,
                        reason: Some("it broke".into()),
                    },
                ],
                ..Attached::default()
            },
        )
        .await
        .unwrap();
    let timeline = app.timeline(&agent).await;
    assert_eq!(
        timeline.last().unwrap()["data"]["code"],
        "event_rejected",
        "the batch was set aside row by row"
    );
    assert_eq!(
        row().await,
        (
            Some(first.uuid()),
            Some("failed".into()),
            Some("bad\u{FFFD}byte".into()),
            "error".into(),
            Some("it broke".into())
        )
    );

    app.writer
        .append_committed_with(
            vec![event("next")],
            Attached {
                changes: vec![
                    StateChange::TurnStarted {
                        agent: id,
                        turn: second,
                    },
                    StateChange::TurnEnded {
                        agent: id,
                        turn: first,
                        outcome: TurnOutcome::Completed,
                        error: None,
                    },
                    StateChange::Status {
                        agent: id,
                        status: AgentStatus::Running,
                        reason: None,
                    },
                ],
                ..Attached::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        row().await,
        (Some(second.uuid()), None, None, "running".into(), None),
        "the newer turn stays open"
    );
    app.stop().await;
}

/// A whole message is stored compressed with lz4 where the database offers it (much
/// cheaper than pglz inside the writer's statement), with pglz where it does not; either
/// way it reads back whole.
#[tokio::test]
async fn a_large_event_is_compressed_with_lz4_where_the_database_offers_it() {
    let app = spawn_app().await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let id = app.agent_in_new_workspace(&project, "mock").await;
    app.prompt(&id, "/load 2000 0").await;
    let w = app.wait(&id).await;
    assert_eq!(w["last_turn"]["outcome"], "completed", "{w}");
    let offered: bool = sqlx::query_scalar(
        "SELECT 'lz4' = ANY (enumvals) FROM pg_settings WHERE name = 'default_toast_compression'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let (method, text): (Option<String>, String) = sqlx::query_as(
        "SELECT pg_column_compression(data), data->>'text' FROM agent_events
         WHERE kind = 'assistant_message'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(
        text.len() > 8_000,
        "a message worth compressing: {}",
        text.len()
    );
    let expected = if offered { "lz4" } else { "pglz" };
    assert_eq!(method.as_deref(), Some(expected));
    let stored = app.timeline(&id).await;
    let deltas: String = stored
        .iter()
        .filter(|e| e["kind"] == "assistant_delta")
        .map(|e| e["data"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, text, "the message reads back whole");
    app.stop().await;
}

/// A pooled connection that broke while idle (a database restart, a proxy that drops
/// quiet connections) is found out by the ping it gets before it is handed out again,
/// and replaced: the next query works.
#[tokio::test]
async fn a_connection_broken_while_idle_is_replaced_before_use() {
    let app = spawn_app().await;
    let pool = agentry::store::connect((*app.pool.connect_options()).clone(), 1)
        .await
        .unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
        .bind(pid)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(ended, "the pool's connection was ended");
    tokio::time::sleep(agentry::store::PING_IDLE_AFTER + Duration::from_millis(200)).await;
    let again: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .expect("the broken connection is replaced, not handed out");
    assert_ne!(again, pid);
}

/// A commit that hangs (here: on a row lock) holds back only what must follow it: the
/// same agent's later events and the next state changes wait, another agent's events
/// commit beside it; once it lands, everything lands in order.
#[tokio::test]
async fn a_slow_commit_holds_back_only_what_must_follow_it() {
    let (app, _repo, ids) = app_with_agents(|s| s.events.commit_wait_ms = 60_000, 3).await;
    let (slow, other, next) = (ids[0], ids[1], ids[2]);
    let event = delta;
    let with_status = |agent: AgentId, text: &str| with_status(&app.writer, agent, text);
    let stored = |text: &'static str| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM agent_events WHERE data->>'text' = $1",
            )
            .bind(text)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };

    // The first agent's row is locked: its state change cannot commit.
    let mut lock = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM agents WHERE id = $1 FOR UPDATE")
        .bind(slow.uuid())
        .execute(&mut *lock)
        .await
        .unwrap();
    let hanging = with_status(slow, "slow-1");
    until_a_statement_waits_on_a_lock(&app.pool, "", "the commit never waited on the lock").await;

    app.writer.append(event(slow, "slow-2")).await.unwrap();
    let serial = with_status(next, "next-1");
    let beside = tokio::time::timeout(
        Duration::from_secs(20),
        app.writer
            .append_committed(vec![event(other, "other-1")], Vec::new()),
    )
    .await
    .expect("another agent's events commit beside the hanging commit")
    .unwrap();
    assert_eq!(beside.len(), 1);
    assert_eq!(stored("other-1").await, 1);
    assert!(!hanging.is_finished());
    assert!(!serial.is_finished(), "state changes wait their turn");
    for text in ["slow-1", "slow-2", "next-1"] {
        assert_eq!(stored(text).await, 0, "{text} overtook the hanging commit");
    }

    lock.rollback().await.unwrap();
    hanging.await.unwrap().unwrap();
    serial.await.unwrap().unwrap();
    app.writer.flush().await.unwrap();
    let seq_of = |timeline: &[Value], text: &str| {
        timeline
            .iter()
            .find(|e| e["data"]["text"] == text)
            .unwrap_or_else(|| panic!("{text} is stored"))["seq"]
            .as_i64()
            .unwrap()
    };
    let timeline = app.timeline(&slow.to_string()).await;
    assert_eq!(seq_of(&timeline, "slow-2"), seq_of(&timeline, "slow-1") + 1);
    let seqs: Vec<i64> = timeline
        .iter()
        .map(|e| e["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    assert_eq!(stored("next-1").await, 1);
    app.stop().await;
}

/// `events.team_linger_ms` holds state changes (and team events) back that long, so that
/// those of a burst share a commit; other agents' events do not wait for them, and a full
/// batch goes at once.
#[tokio::test]
async fn state_changes_linger_to_share_a_commit_and_nothing_else_waits_for_them() {
    let tweak = |s: &mut Settings| {
        s.events.team_linger_ms = 1_000;
        s.events.batch_max_events = 4;
        s.events.commit_wait_ms = 30_000;
    };
    let (app, _repo, ids) = app_with_agents(tweak, 3).await;
    let (a, b, c) = (ids[0], ids[1], ids[2]);
    // Rows inserted by one transaction share its id.
    let transaction_of = |text: &'static str| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT xmin::text FROM agent_events WHERE data->>'text' = $1",
            )
            .bind(text)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };

    let started = std::time::Instant::now();
    let first = with_status(&app.writer, a, "a-1");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = with_status(&app.writer, b, "b-1");
    app.writer
        .append_committed(vec![delta(c, "c-1")], Vec::new())
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "another agent's event waited for the state changes ({:?})",
        started.elapsed()
    );
    assert!(!first.is_finished() && !second.is_finished());
    first.await.unwrap().unwrap();
    second.await.unwrap().unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(950),
        "the state changes lingered ({:?})",
        started.elapsed()
    );
    assert_eq!(
        transaction_of("a-1").await,
        transaction_of("b-1").await,
        "the state changes shared a commit"
    );
    assert_ne!(transaction_of("a-1").await, transaction_of("c-1").await);

    // Four events make a full batch: it does not wait.
    let started = std::time::Instant::now();
    let full = [(a, "a-2"), (b, "b-2"), (c, "c-2"), (a, "a-3")]
        .map(|(agent, text)| with_status(&app.writer, agent, text));
    for op in full {
        op.await.unwrap().unwrap();
    }
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "a full batch waited out the linger ({:?})",
        started.elapsed()
    );
    app.stop().await;
}

/// `events.batch_linger_ms` holds a lone write back that long for others to join it, and
/// `events.batch_max_events` cuts the wait short once the batch is full.
#[tokio::test]
async fn a_batch_lingers_for_company_unless_it_is_full() {
    let tweak = |s: &mut Settings| {
        s.events.batch_linger_ms = 1_500;
        s.events.batch_max_events = 3;
        s.events.commit_wait_ms = 30_000;
    };
    let (app, _repo, ids) = app_with_agents(tweak, 1).await;
    let id = ids[0];
    let event = |text: &str| delta(id, text);

    let started = std::time::Instant::now();
    app.writer
        .append_committed(vec![event("alone")], Vec::new())
        .await
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(1_450),
        "a lone write waited out the linger ({:?})",
        started.elapsed()
    );

    let started = std::time::Instant::now();
    let first = app
        .writer
        .append_committed(vec![event("first")], Vec::new());
    let rest = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        app.writer
            .append_committed(vec![event("second"), event("third")], Vec::new())
            .await
    };
    let (first, rest) = tokio::join!(first, rest);
    let seqs: Vec<i64> = first
        .unwrap()
        .iter()
        .chain(&rest.unwrap())
        .map(|e| e.seq)
        .collect();
    assert!(
        started.elapsed() < Duration::from_millis(1_000),
        "a full batch did not wait out the linger ({:?})",
        started.elapsed()
    );
    assert_eq!(seqs.windows(2).filter(|w| w[1] != w[0] + 1).count(), 0);
    app.stop().await;
}

/// An agent created with a prompt while the store is slow to confirm commits (team
/// events held on a lock past the writer's commit wait): the creation is answered 201, the
/// session opens once and stays, and the first prompt is not lost: its turn is in the
/// timeline (run, or failed with the reason), and the next prompt runs in the same session.
#[tokio::test]
async fn an_agent_created_while_the_store_is_slow_keeps_its_session_and_first_prompt() {
    let app = spawn_app_with(|s| s.events.commit_wait_ms = 300).await;
    let repo = git_repo();
    let project = app.project(repo.path()).await;
    let ws = app
        .post_ok(
            "/v1/workspaces",
            json!({"project_id": project["id"], "kind": "worktree"}),
            201,
        )
        .await;

    let mut lock = app.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE team_events IN SHARE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let created = app
        .post_ok(
            "/v1/agents",
            json!({"workspace_id": ws["id"], "provider": "mock", "prompt": "hello"}),
            201,
        )
        .await;
    let id = created["id"].as_str().unwrap().to_owned();
    // Held past the commit wait, while the session opens and the prompt arrives.
    tokio::time::sleep(Duration::from_millis(900)).await;
    lock.rollback().await.unwrap();

    let first = app.wait(&id).await;
    assert!(
        first["last_turn"]["turn_id"].is_string(),
        "the first prompt has a turn: {first}"
    );
    app.prompt(&id, "again").await;
    let done = app.wait(&id).await;
    assert_eq!(done["last_turn"]["outcome"], "completed", "{done}");
    let timeline = app.timeline(&id).await;
    let count = |kind: &str| timeline.iter().filter(|e| e["kind"] == kind).count();
    assert_eq!(
        count("session_started"),
        1,
        "one session served both prompts"
    );
    assert_eq!(
        count("turn_completed"),
        2,
        "both prompts are in the timeline"
    );
}
