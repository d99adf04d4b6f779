use super::*;

fn config(args: &[&str], env: &[(&str, &str)]) -> CliConfig {
    let mut cfg = crate::providers::registry::builtin_config(&builtin(), "codex", None);
    cfg.args = args.iter().map(|s| s.to_string()).collect();
    cfg.pass_env.clear();
    cfg.env = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    cfg
}

#[test]
fn credentials_come_from_a_key_a_login_file_or_a_custom_provider() {
    let none = |_: &std::path::Path| false;
    let home = [("HOME", "/h"), ("CODEX_HOME", "/ch")];
    let err = credentials(&config(&[], &home), none).unwrap_err();
    assert!(err.contains("OPENAI_API_KEY") && err.contains("/ch/auth.json"), "{err}");
    assert!(credentials(&config(&[], &[("OPENAI_API_KEY", "k")]), none).is_ok());
    assert!(credentials(&config(&[], &[("CODEX_API_KEY", "k")]), none).is_ok());
    let only_home = |p: &std::path::Path| p == std::path::Path::new("/h/.codex/auth.json");
    assert!(credentials(&config(&[], &[("HOME", "/h")]), only_home).is_ok());

    let custom = [
        "-c",
        "model_provider=fake",
        "-c",
        r#"model_providers.fake={name="Fake",base_url="http://x/v1",env_key="FAKE_KEY"}"#,
    ];
    let err = credentials(&config(&custom, &[("OPENAI_API_KEY", "k")]), none).unwrap_err();
    assert!(err.contains("`fake`") && err.contains("FAKE_KEY"), "{err}");
    assert!(credentials(&config(&custom, &[("FAKE_KEY", "k")]), none).is_ok());
    let keyless = ["-c", "model_provider=local", "--config=model_providers.local.base_url=\"http://x\""];
    assert!(credentials(&config(&keyless, &[]), none).is_ok());
    // A built-in provider name is not a custom one: the usual credentials apply.
    assert!(credentials(&config(&["-c", "model_provider=openai"], &[]), none).is_err());
}

#[test]
fn mcp_servers_become_config_overrides() {
    let servers: BTreeMap<String, Value> = serde_json::from_value(json!({
        "files": {"command": ["npx", "srv"], "args": ["--root", "a b"], "env": {"TOKEN": "t\"x"}},
        "web": {"type": "http", "url": "http://127.0.0.1:1/mcp", "headers": [{"name": "X-K", "value": "v"}]},
    }))
    .unwrap();
    let args = mcp_overrides(&servers).unwrap();
    assert_eq!(
        args,
        [
            "-c",
            r#"mcp_servers.files.command="npx""#,
            "-c",
            r#"mcp_servers.files.args=["srv", "--root", "a b"]"#,
            "-c",
            r#"mcp_servers.files.env={ "TOKEN" = 't"x' }"#,
            "-c",
            r#"mcp_servers.web.url="http://127.0.0.1:1/mcp""#,
            "-c",
            r#"mcp_servers.web.http_headers={ "X-K" = "v" }"#,
        ]
    );
    let bad: BTreeMap<String, Value> =
        serde_json::from_value(json!({"a.b": {"command": "x"}})).unwrap();
    assert!(mcp_overrides(&bad).is_err());
}

#[test]
fn modes_are_policies() {
    assert_eq!(policy("read-only").unwrap().0, "untrusted");
    assert_eq!(policy("auto").unwrap().1, "workspace-write");
    assert_eq!(policy("full-access").unwrap().2, json!({"type": "dangerFullAccess"}));
    assert!(policy("yolo").is_none());
    let ids: Vec<String> = modes().into_iter().map(|m| m.id).collect();
    assert!(ids.iter().all(|m| policy(m).is_some()));
}

#[test]
fn the_catalog_skips_hidden_models() {
    let page = json!({"data": [
        {"id": "a", "displayName": "A", "isDefault": true, "hidden": false},
        {"id": "h", "displayName": "H", "hidden": true},
        {"id": "b", "model": "b"},
    ], "nextCursor": null});
    let models = catalog(&page);
    let ids: Vec<(&str, &str, bool)> = models
        .iter()
        .map(|m| (m.id.as_str(), m.label.as_str(), m.is_default))
        .collect();
    assert_eq!(ids, [("a", "A", true), ("b", "b", false)]);
}
