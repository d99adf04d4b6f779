use super::handshake::mcp_servers;
use super::mapping::prompt_usage;
use super::*;

fn update(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => unreachable!(),
    }
}

#[test]
fn announced_modes_and_models_are_read_from_either_shape() {
    let ids = |a: &Announced| {
        (
            a.modes.iter().map(|m| m.id.clone()).collect::<Vec<_>>(),
            a.models
                .iter()
                .map(|m| (m.id.clone(), m.is_default))
                .collect::<Vec<_>>(),
        )
    };
    let mut a = Announced::default();
    a.absorb(&json!({
        "modes": {"currentModeId": "ask", "availableModes": [{"id": "ask", "name": "Ask"}, {"id": "code"}]},
        "models": {"currentModelId": "b", "availableModels": [{"modelId": "a", "name": "A"}, {"modelId": "b"}]}
    }));
    assert_eq!(
        ids(&a),
        (
            vec!["ask".to_owned(), "code".to_owned()],
            vec![("a".to_owned(), false), ("b".to_owned(), true)]
        )
    );
    assert_eq!(a.modes[1].label, "code");
    // Config options (codex-acp), a grouped select among them; what an answer leaves
    // out is kept.
    a.absorb(&json!({"configOptions": [
        {"id": "effort", "category": "thought_level", "type": "select", "currentValue": "low",
         "options": [{"value": "low", "name": "Low"}]},
        {"id": "model", "category": "model", "type": "select", "currentValue": "y",
         "options": [{"group": "g", "name": "G", "options": [{"value": "x", "name": "X"}, {"value": "y", "name": "Y"}]}]}
    ]}));
    assert_eq!(
        ids(&a),
        (
            vec!["ask".to_owned(), "code".to_owned()],
            vec![("x".to_owned(), false), ("y".to_owned(), true)]
        )
    );
    a.absorb(
        &json!({"configOptions": [{"id": "mode", "type": "select", "currentValue": "r",
        "options": [{"value": "r", "name": "Read", "description": "reads"}]}]}),
    );
    assert_eq!(a.modes.len(), 1);
    assert_eq!(
        (a.modes[0].id.as_str(), a.modes[0].description.as_deref()),
        ("r", Some("reads"))
    );
}

#[test]
fn partial_updates_complete_from_earlier_state() {
    let mut tools = ToolTracker::default();
    let (first, _) = tools
        .apply(
            &mut update(json!({"toolCallId": "c1", "title": "ls", "kind": "execute", "status": "in_progress",
                "rawInput": {"command": "ls"}})),
            true,
        )
        .unwrap();
    assert_eq!(first.tool_kind, ToolKind::Shell);
    assert_eq!(first.status, ToolStatus::Running);
    assert_eq!(first.name, "shell");
    let (second, _) = tools
        .apply(
            &mut update(
                json!({"toolCallId": "c1", "status": "completed", "rawOutput": {"stdout": "x"}}),
            ),
            false,
        )
        .unwrap();
    assert_eq!(second.title, "ls");
    assert_eq!(second.tool_kind, ToolKind::Shell);
    assert_eq!(second.input, json!({"command": "ls"}));
    assert_eq!(second.output, Some(json!({"stdout": "x"})));
    assert_eq!(second.status, ToolStatus::Completed);
}

#[test]
fn edit_of_new_files_is_a_write() {
    let mut tools = ToolTracker::default();
    let diff = json!([{"type": "diff", "path": "/w/a", "oldText": null, "newText": "x"}]);
    let (call, _) = tools
        .apply(
            &mut update(
                json!({"toolCallId": 7, "title": "Write a", "kind": "edit", "content": diff}),
            ),
            true,
        )
        .unwrap();
    assert_eq!(call.call_id, "7");
    assert_eq!(call.tool_kind, ToolKind::Write);
    assert_eq!(
        call.diff,
        [FileDiff {
            path: "/w/a".into(),
            change: ChangeKind::Add,
            move_path: None,
            unified: None,
            old_text: None,
            new_text: Some("x".into()),
        }]
    );
    let (edit, _) = tools
        .apply(
            &mut update(json!({"toolCallId": "e", "kind": "edit",
                "content": [{"type": "diff", "path": "/w/a", "oldText": "a", "newText": "b"}]})),
            false,
        )
        .unwrap();
    assert_eq!(edit.tool_kind, ToolKind::Edit);
}

#[test]
fn options_get_agentry_ids_by_kind_and_answer_with_the_agents_ids() {
    // Gemini's, codex-acp's and an agent's without kinds.
    let gemini = permission_options(&[
        json!({"optionId": "proceed_always", "name": "Always", "kind": "allow_always"}),
        json!({"optionId": "proceed_once", "name": "Yes", "kind": "allow_once"}),
        json!({"optionId": "cancel", "name": "No", "kind": "reject_once"}),
    ]);
    let shown: Vec<(&str, Behavior)> = gemini
        .iter()
        .map(|(o, _)| (o.id.as_str(), o.behavior))
        .collect();
    assert_eq!(
        shown,
        [
            ("allow_always", Behavior::Allow),
            ("allow", Behavior::Allow),
            ("deny", Behavior::Deny)
        ]
    );
    let answer = |chosen: &str, behavior| provider_option(&gemini, chosen, behavior);
    assert_eq!(
        answer("allow", Behavior::Allow).as_deref(),
        Some("proceed_once")
    );
    assert_eq!(answer("deny", Behavior::Deny).as_deref(), Some("cancel"));
    assert_eq!(
        answer("proceed_always", Behavior::Allow).as_deref(),
        Some("proceed_always")
    );
    assert_eq!(
        answer("nonsense", Behavior::Deny).as_deref(),
        Some("cancel")
    );

    let codex = permission_options(&[
        json!({"optionId": "approved", "name": "Yes", "kind": "allow_once"}),
        json!({"optionId": "approved-for-session", "name": "Yes, this session", "kind": "allow_once"}),
        json!({"optionId": "abort", "name": "No"}),
    ]);
    let ids: Vec<&str> = codex.iter().map(|(o, _)| o.id.as_str()).collect();
    assert_eq!(ids, ["allow", "allow_2", "deny"]);
    assert_eq!(codex[2].0.behavior, Behavior::Deny);
    assert_eq!(
        provider_option(&codex, "allow_2", Behavior::Allow).as_deref(),
        Some("approved-for-session")
    );
}

#[tokio::test]
async fn paths_must_stay_in_the_workspace() {
    use crate::providers::workspace_files::{relative_to, write};
    let dir = tempfile::tempdir().unwrap();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let rel = |p: &Path| relative_to(&root, p);
    assert_eq!(
        rel(&root.join("new/file.txt")).unwrap(),
        Path::new("new/file.txt")
    );
    assert!(rel(Path::new("/etc/passwd")).is_err());
    // The workspace through a symlinked parent.
    let alias_dir = tempfile::tempdir().unwrap();
    let alias = alias_dir.path().join("ws");
    std::os::unix::fs::symlink(&root, &alias).unwrap();
    assert_eq!(
        rel(&alias.join("new/file.txt")).unwrap(),
        Path::new("new/file.txt")
    );
    let escape = rel(&root.join("../escape.txt")).unwrap();
    assert!(write(&root, &escape, b"x".to_vec()).await.is_err());

    // Symlinks that lead out are refused, dangling ones included.
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), root.join("out")).unwrap();
    assert!(
        write(&root, Path::new("out/new.txt"), b"x".to_vec())
            .await
            .is_err()
    );
    std::os::unix::fs::symlink(outside.path().join("later.txt"), root.join("dangling")).unwrap();
    assert!(
        write(&root, Path::new("dangling"), b"x".to_vec())
            .await
            .is_err()
    );
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
    // So is git's metadata.
    assert!(
        write(&root, Path::new(".Git/config"), b"x".to_vec())
            .await
            .is_err()
    );
    assert!(!root.join(".Git").exists());
    // A directory symlink that stays inside is fine.
    std::fs::create_dir_all(root.join("real")).unwrap();
    std::os::unix::fs::symlink(root.join("real"), root.join("alias")).unwrap();
    write(&root, Path::new("alias/f.txt"), b"x".to_vec())
        .await
        .unwrap();
    assert!(root.join("real/f.txt").exists());
}

#[test]
fn mcp_servers_become_acp_declarations() {
    let servers = BTreeMap::from([
        (
            "files".to_owned(),
            json!({"command": "mcp-files", "args": ["--root", "."], "env": {"TOKEN": "t"}}),
        ),
        (
            "argv".to_owned(),
            json!({"command": ["npx", "server"], "args": ["-v"]}),
        ),
        (
            "web".to_owned(),
            json!({"type": "http", "url": "https://mcp.example", "headers": {"Authorization": "x"}}),
        ),
        ("broken".to_owned(), json!({"args": []})),
    ]);
    let without_http = mcp_servers(&servers, &proto::McpCapabilities::new());
    let names: Vec<Value> = without_http
        .iter()
        .map(|s| serde_json::to_value(s).unwrap())
        .collect();
    assert_eq!(
        names,
        [
            json!({"name": "argv", "command": "npx", "args": ["server", "-v"], "env": []}),
            json!({"name": "files", "command": "mcp-files", "args": ["--root", "."],
                "env": [{"name": "TOKEN", "value": "t"}]}),
        ]
    );
    let with_http = mcp_servers(&servers, &proto::McpCapabilities::new().http(true));
    assert_eq!(with_http.len(), 3);
    assert!(
        serde_json::to_value(&with_http[2])
            .unwrap()
            .get("type")
            .is_some_and(|t| t == "http")
    );
}

/// What Gemini CLI 0.61.0 sent for an approved `write_file` in `default` mode
/// (recorded; workspace paths shortened to `/w`), mapped as the adapter maps it.
#[test]
fn a_recorded_gemini_write_maps_to_one_call_its_request_and_usage() {
    const WRITE_ALLOW: &str = include_str!("../../../tests/fixtures/gemini/write_allow.jsonl");
    let mut tools = ToolTracker::default();
    let mut calls = Vec::new();
    let mut asked = None;
    let mut usage = None;
    for line in WRITE_ALLOW.lines() {
        let mut message: Value = serde_json::from_str(line).unwrap();
        match message["method"].as_str() {
            Some("session/update") => {
                let update = message["params"]["update"].as_object_mut().unwrap();
                let tag = update["sessionUpdate"].as_str().unwrap().to_owned();
                if tag == "tool_call" || tag == "tool_call_update" {
                    let (call, _) = tools.apply(update, tag == "tool_call").unwrap();
                    calls.push(call);
                }
            }
            Some("session/request_permission") => {
                let params = &mut message["params"];
                let offered = permission_options(params["options"].as_array().unwrap());
                let call = params["toolCall"].as_object_mut().unwrap();
                // Never announced before: the request creates it.
                let (call, changed) = tools.apply(call, false).unwrap();
                assert!(changed);
                calls.push(call);
                asked = Some(offered);
            }
            Some(_) => {}
            None if message["result"].get("stopReason").is_some() => {
                usage = prompt_usage(&message["result"]);
            }
            None => {}
        }
    }
    let [pending, done] = calls.as_slice() else {
        panic!("{calls:?}")
    };
    assert_eq!(pending.call_id, "write_file__write_file_1796125801389_0");
    assert_eq!(pending.status, ToolStatus::Pending);
    assert_eq!(pending.title, "Writing to hello.txt");
    assert_eq!(done.call_id, pending.call_id);
    assert_eq!(done.status, ToolStatus::Completed);
    assert_eq!(done.tool_kind, ToolKind::Write, "a new file is a write");
    assert_eq!(
        done.diff,
        [FileDiff {
            path: "/w/hello.txt".into(),
            change: ChangeKind::Add,
            move_path: None,
            unified: None,
            old_text: None,
            new_text: Some("hello from gemini\n".into()),
        }]
    );
    assert_eq!(done.locations[0].path, "/w/hello.txt");
    let offered = asked.expect("a permission request");
    let ids: Vec<&str> = offered.iter().map(|(o, _)| o.id.as_str()).collect();
    assert_eq!(ids, ["allow_always", "allow", "deny"]);
    assert_eq!(
        provider_option(&offered, "allow", Behavior::Allow).as_deref(),
        Some("proceed_once")
    );
    let usage = usage.expect("usage");
    assert_eq!((usage.input_tokens, usage.output_tokens), (240, 30));
}

#[test]
fn gemini_reports_usage_in_its_quota_meta() {
    // As Gemini CLI 0.61.0 answers `session/prompt`.
    let answer = json!({"stopReason": "end_turn", "_meta": {"quota": {
        "token_count": {"input_tokens": 240, "output_tokens": 30},
        "model_usage": [{"model": "gemini-2.5-flash",
            "token_count": {"input_tokens": 240, "output_tokens": 30}}]}}});
    let usage = prompt_usage(&answer).expect("usage");
    assert_eq!((usage.input_tokens, usage.output_tokens), (240, 30));
    assert_eq!(prompt_usage(&json!({"stopReason": "end_turn"})), None);
}

#[test]
fn prompt_answers_end_turns() {
    let ended = |result, interrupted| match turn_end(result, interrupted) {
        Some(ProviderEvent::TurnEnded { outcome, error, .. }) => Some((outcome, error)),
        _ => None,
    };
    assert_eq!(
        ended(Ok(json!({"stopReason": "end_turn"})), false),
        Some((TurnOutcome::Completed, None))
    );
    assert_eq!(
        ended(Ok(json!({"stopReason": "cancelled"})), true),
        Some((TurnOutcome::Canceled, None))
    );
    assert_eq!(
        ended(Ok(json!({"stopReason": "refusal"})), false),
        Some((TurnOutcome::Failed, Some("the agent refused".to_owned())))
    );
    assert_eq!(
        ended(
            Err(acp::Error::new(acp::ErrorCode::INTERNAL_ERROR, "boom")),
            false
        ),
        Some((TurnOutcome::Failed, Some("boom".to_owned())))
    );
    assert_eq!(
        ended(
            Err(acp::Error::new(acp::ErrorCode::INTERNAL_ERROR, "late")),
            true
        ),
        Some((TurnOutcome::Canceled, None))
    );
}
