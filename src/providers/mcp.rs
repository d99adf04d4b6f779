//! Reading an agent's MCP servers as the create-agent request gives them (`command` as a
//! program or a whole argv, `args`, `env`; `url`, `headers`), for each adapter to put in
//! its CLI's own shape.

use serde_json::Value;

/// A value as text: a string as it is, anything else as its JSON.
pub fn text(value: &Value) -> String {
    value
        .as_str()
        .map_or_else(|| value.to_string(), str::to_owned)
}

/// Name-value pairs (`env`, `headers`), given as an object or as a list of
/// `{"name", "value"}` objects.
pub fn pairs(value: Option<&Value>) -> Vec<(String, String)> {
    match value {
        Some(Value::Object(map)) => map.iter().map(|(k, v)| (k.clone(), text(v))).collect(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|item| {
                Some((
                    item.get("name")?.as_str()?.to_owned(),
                    text(item.get("value")?),
                ))
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// A stdio server's argv: its `command` (a program, or a whole argv), then its `args`.
/// Empty when it names neither.
pub fn argv(server: &Value) -> Vec<String> {
    let mut argv = command(server);
    argv.extend(args(server));
    argv
}

/// What a stdio server's `command` says: a program, or a whole argv.
pub fn command(server: &Value) -> Vec<String> {
    match server.get("command") {
        Some(Value::String(c)) => vec![c.clone()],
        Some(Value::Array(items)) => items.iter().map(text).collect(),
        _ => Vec::new(),
    }
}

/// A stdio server's `args`.
pub fn args(server: &Value) -> Vec<String> {
    match server.get("args") {
        Some(Value::Array(items)) => items.iter().map(text).collect(),
        _ => Vec::new(),
    }
}
