//! Mode presets: agentry modes that an agent offers as a combination of its session config
//! options rather than as one ACP mode. Copilot is the case in point: whether it asks
//! before a tool runs is its `allow_all` option, apart from its `mode` option (agent,
//! plan, autopilot), so "agent mode without asking" is two settings at once.
//!
//! A preset names the values it wants by the option's id and a value word. The word
//! matches a value that equals it or whose last `#fragment` or `/segment` equals it —
//! Copilot's mode values are URLs (`…/session-modes#agent`), and the full URL is always
//! taken from what the agent itself offers, never assumed. A boolean option takes
//! `on`/`off` (or `true`/`false`).

use agent_client_protocol::v1::schema as proto;

/// One agentry mode as config option settings, applied in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModePreset {
    pub id: String,
    /// `(config option id, value word)` pairs.
    pub settings: Vec<(String, String)>,
}

impl ModePreset {
    pub fn new(id: &str, settings: &[(&str, &str)]) -> Self {
        Self {
            id: id.to_owned(),
            settings: settings
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }
}

/// Whether `actual` (an agent's value id) is what `word` asks for.
pub fn value_matches(actual: &str, word: &str) -> bool {
    actual == word || actual.rsplit(['#', '/']).next() == Some(word)
}

fn word_is_true(word: &str) -> Option<bool> {
    match word {
        "on" | "true" => Some(true),
        "off" | "false" => Some(false),
        _ => None,
    }
}

/// The option's current value matches `word`.
fn current_matches(option: &proto::SessionConfigOption, word: &str) -> bool {
    match &option.kind {
        proto::SessionConfigKind::Select(select) => {
            value_matches(&select.current_value.to_string(), word)
        }
        proto::SessionConfigKind::Boolean(boolean) => {
            word_is_true(word) == Some(boolean.current_value)
        }
        _ => false,
    }
}

/// The value to send so that `option` takes `word`: the agent's own value id for a select,
/// a boolean for a toggle. `None` when the option offers nothing that matches.
pub fn value_for(
    option: &proto::SessionConfigOption,
    word: &str,
) -> Option<proto::SessionConfigOptionValue> {
    match &option.kind {
        proto::SessionConfigKind::Select(select) => {
            let values: Vec<String> = match &select.options {
                proto::SessionConfigSelectOptions::Ungrouped(options) => {
                    options.iter().map(|o| o.value.to_string()).collect()
                }
                proto::SessionConfigSelectOptions::Grouped(groups) => groups
                    .iter()
                    .flat_map(|g| g.options.iter().map(|o| o.value.to_string()))
                    .collect(),
                _ => Vec::new(),
            };
            values
                .into_iter()
                .find(|v| value_matches(v, word))
                .map(proto::SessionConfigOptionValue::value_id)
        }
        proto::SessionConfigKind::Boolean(_) => {
            word_is_true(word).map(proto::SessionConfigOptionValue::boolean)
        }
        _ => None,
    }
}

/// The preset the options currently amount to: the first whose settings all hold, else
/// the first whose first setting holds (Copilot's plan mode with `allow_all` on still
/// reads as plan). `None` when the options say nothing a preset knows.
pub fn current_preset<'a>(
    presets: &'a [ModePreset],
    options: &[proto::SessionConfigOption],
) -> Option<&'a ModePreset> {
    let holds = |(id, word): &(String, String)| {
        options
            .iter()
            .find(|o| &*o.id.0 == id.as_str())
            .is_some_and(|o| current_matches(o, word))
    };
    presets
        .iter()
        .find(|p| !p.settings.is_empty() && p.settings.iter().all(holds))
        .or_else(|| {
            presets
                .iter()
                .find(|p| p.settings.first().is_some_and(holds))
        })
}

/// What must be sent, in order, for `preset` to hold: `(option id, value)` for each
/// setting not in force yet. Errors name a setting the agent does not offer.
pub fn changes_for(
    preset: &ModePreset,
    options: &[proto::SessionConfigOption],
) -> Result<Vec<(String, proto::SessionConfigOptionValue)>, String> {
    let mut out = Vec::new();
    for (id, word) in &preset.settings {
        let Some(option) = options.iter().find(|o| &*o.id.0 == id.as_str()) else {
            return Err(format!("the agent offers no `{id}` option"));
        };
        if current_matches(option, word) {
            continue;
        }
        let Some(value) = value_for(option, word) else {
            return Err(format!("the agent's `{id}` option has no value `{word}`"));
        };
        out.push((id.clone(), value));
    }
    Ok(out)
}

/// `options` with `update` merged in by option id (an agent may report only some).
pub fn merge_options(
    options: &mut Vec<proto::SessionConfigOption>,
    update: &[proto::SessionConfigOption],
) {
    for option in update {
        match options.iter_mut().find(|o| o.id == option.id) {
            Some(known) => *known = option.clone(),
            None => options.push(option.clone()),
        }
    }
}

/// Record that the agent's mode option (category `mode`, else id `mode`) now has `value`
/// (a `current_mode_update` of an agent whose modes are also a config option).
pub fn set_mode_value(options: &mut [proto::SessionConfigOption], value: &str) {
    let is_mode = |o: &proto::SessionConfigOption| {
        matches!(o.category, Some(proto::SessionConfigOptionCategory::Mode))
            || (o.category.is_none() && &*o.id.0 == "mode")
    };
    if let Some(option) = options.iter_mut().find(|o| is_mode(o))
        && let proto::SessionConfigKind::Select(select) = &mut option.kind
    {
        select.current_value = value.to_owned().into();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The config options Copilot 1.0.102 answered `session/new` with (recorded).
    fn copilot_options(mode: &str, allow_all: &str) -> Vec<proto::SessionConfigOption> {
        let url = |m: &str| format!("https://agentclientprotocol.com/protocol/session-modes#{m}");
        serde_json::from_value(json!([
            {"type": "select", "id": "mode", "name": "Mode", "category": "mode",
             "currentValue": url(mode),
             "options": [
                {"value": url("agent"), "name": "Agent"},
                {"value": url("plan"), "name": "Plan"},
                {"value": url("autopilot"), "name": "Autopilot"}]},
            {"type": "select", "id": "allow_all", "name": "Allow All", "category": "permissions",
             "currentValue": allow_all,
             "options": [{"value": "on", "name": "On"}, {"value": "off", "name": "Off"}]}
        ]))
        .unwrap()
    }

    fn presets() -> Vec<ModePreset> {
        vec![
            ModePreset::new("agent", &[("mode", "agent"), ("allow_all", "off")]),
            ModePreset::new("plan", &[("mode", "plan"), ("allow_all", "off")]),
            ModePreset::new("allow-all", &[("mode", "agent"), ("allow_all", "on")]),
        ]
    }

    #[test]
    fn url_values_match_by_fragment() {
        assert!(value_matches(
            "https://x/protocol/session-modes#agent",
            "agent"
        ));
        assert!(value_matches("https://x/modes/plan", "plan"));
        assert!(value_matches("on", "on"));
        assert!(!value_matches("https://x/session-modes#autopilot", "agent"));
    }

    #[test]
    fn the_options_read_as_a_preset() {
        let presets = presets();
        let id = |m, a| current_preset(&presets, &copilot_options(m, a)).map(|p| p.id.as_str());
        assert_eq!(id("agent", "off"), Some("agent"));
        assert_eq!(id("agent", "on"), Some("allow-all"));
        assert_eq!(id("plan", "off"), Some("plan"));
        // No preset has plan with allow_all on: it reads as plan.
        assert_eq!(id("plan", "on"), Some("plan"));
        assert_eq!(id("autopilot", "on"), None);
    }

    #[test]
    fn a_preset_is_reached_with_the_agents_own_values() {
        let presets = presets();
        let changes = changes_for(&presets[1], &copilot_options("agent", "on")).unwrap();
        // As the requests go on the wire (the form Copilot accepted).
        let sent: Vec<serde_json::Value> = changes
            .into_iter()
            .map(|(id, v)| {
                serde_json::to_value(proto::SetSessionConfigOptionRequest::new("s", id, v)).unwrap()
            })
            .collect();
        assert_eq!(
            sent,
            [
                json!({"sessionId": "s", "configId": "mode",
                    "value": "https://agentclientprotocol.com/protocol/session-modes#plan"}),
                json!({"sessionId": "s", "configId": "allow_all", "value": "off"}),
            ]
        );
        // What already holds is not sent again.
        let none = changes_for(&presets[2], &copilot_options("agent", "on")).unwrap();
        assert!(none.is_empty());
        let missing = ModePreset::new("x", &[("sandbox", "on")]);
        assert!(changes_for(&missing, &copilot_options("agent", "off")).is_err());
        let unknown = ModePreset::new("x", &[("mode", "yolo")]);
        assert!(changes_for(&unknown, &copilot_options("agent", "off")).is_err());
    }

    #[test]
    fn boolean_options_take_on_and_off() {
        let options: Vec<proto::SessionConfigOption> = serde_json::from_value(json!([
            {"type": "boolean", "id": "allow_all", "name": "Allow all", "currentValue": false}
        ]))
        .unwrap();
        let preset = ModePreset::new("yolo", &[("allow_all", "on")]);
        let changes = changes_for(&preset, &options).unwrap();
        let (id, value) = changes[0].clone();
        assert_eq!(
            serde_json::to_value(proto::SetSessionConfigOptionRequest::new("s", id, value))
                .unwrap(),
            json!({"sessionId": "s", "configId": "allow_all", "type": "boolean", "value": true})
        );
        assert!(current_preset(std::slice::from_ref(&preset), &options).is_none());
    }

    #[test]
    fn updates_merge_by_id_and_a_mode_update_moves_the_mode_option() {
        let mut options = copilot_options("agent", "off");
        let update = copilot_options("agent", "on");
        merge_options(&mut options, &update[1..]);
        assert_eq!(options.len(), 2);
        assert_eq!(
            current_preset(&presets(), &options).map(|p| p.id.as_str()),
            Some("allow-all")
        );
        set_mode_value(
            &mut options,
            "https://agentclientprotocol.com/protocol/session-modes#plan",
        );
        assert_eq!(
            current_preset(&presets(), &options).map(|p| p.id.as_str()),
            Some("plan")
        );
    }
}
