//! Secret values in memory: a team's model credentials on their way from the store to a
//! provider's child process. The wrapper has no `Serialize`, and its `Debug` and `Display`
//! print `[redacted]`, so a value cannot reach a log line, an error or an API answer by
//! being formatted; code that needs the text calls `expose` on purpose.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

/// A secret text, redacted wherever it is formatted. It can be read from a request body
/// but never written to one.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct SecretValue(String);

impl SecretValue {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The text itself, for the one place that hands it on (a child's environment, the
    /// cipher).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl fmt::Display for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

/// Environment variables whose values are secrets, by name.
pub type SecretEnv = BTreeMap<String, SecretValue>;

/// What a secret value becomes in text that is stored or shown.
pub const REDACTED: &str = "[redacted]";

/// Values shorter than this are not searched for: a one-letter "secret" would blank out
/// every word that contains the letter and protect nothing.
const MIN_REDACTED_LEN: usize = 4;

/// Masks an agent's secret values in what its provider reports (a tool that prints the
/// environment, a CLI that quotes its key in an error), before it reaches a timeline, a
/// status reason or a turn's error.
#[derive(Clone, Default)]
pub struct Redactor {
    /// Longest first, so a value that contains another is masked whole.
    values: Vec<String>,
}

impl fmt::Debug for Redactor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Redactor({} values)", self.values.len())
    }
}

impl Redactor {
    pub fn new(env: &SecretEnv) -> Self {
        let mut values: Vec<String> = env
            .values()
            .map(|v| v.expose().to_owned())
            .filter(|v| v.len() >= MIN_REDACTED_LEN)
            .collect();
        values.sort_by_key(|v| std::cmp::Reverse(v.len()));
        values.dedup();
        Self { values }
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// `text` with every secret value replaced by `[redacted]`.
    pub fn text<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
        let mut out = std::borrow::Cow::Borrowed(text);
        for v in &self.values {
            if out.contains(v.as_str()) {
                out = std::borrow::Cow::Owned(out.replace(v.as_str(), REDACTED));
            }
        }
        out
    }

    /// Mask secret values in every string (and object key) of `value`, in place.
    pub fn json(&self, value: &mut serde_json::Value) {
        use serde_json::Value;
        if self.is_empty() {
            return;
        }
        match value {
            Value::String(s) => {
                if let std::borrow::Cow::Owned(masked) = self.text(s) {
                    *s = masked;
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| self.json(v)),
            Value::Object(map) => {
                if map
                    .keys()
                    .any(|k| matches!(self.text(k), std::borrow::Cow::Owned(_)))
                {
                    let old = std::mem::take(map);
                    for (k, v) in old {
                        map.insert(self.text(&k).into_owned(), v);
                    }
                }
                map.values_mut().for_each(|v| self.json(v));
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_redacted_when_formatted() {
        let v = SecretValue::new("sk-live-123");
        assert_eq!(format!("{v:?}"), "[redacted]");
        assert_eq!(format!("{v}"), "[redacted]");
        let env = SecretEnv::from([("KEY".to_owned(), v.clone())]);
        assert!(!format!("{env:?}").contains("sk-live"));
        assert_eq!(v.expose(), "sk-live-123");
    }

    #[test]
    fn the_redactor_masks_values_in_text_and_json() {
        let env = SecretEnv::from([
            ("A".to_owned(), SecretValue::new("sk-abc")),
            ("B".to_owned(), SecretValue::new("sk-abc-longer")),
            ("C".to_owned(), SecretValue::new("x")),
        ]);
        let r = Redactor::new(&env);
        assert_eq!(
            r.text("A=sk-abc B=sk-abc-longer x"),
            "A=[redacted] B=[redacted] x"
        );
        let mut v = serde_json::json!({"output": ["key sk-abc-longer!"], "sk-abc": 1, "n": 2});
        r.json(&mut v);
        assert_eq!(
            v,
            serde_json::json!({"output": ["key [redacted]!"], "[redacted]": 1, "n": 2})
        );
        assert!(matches!(r.text("nothing"), std::borrow::Cow::Borrowed(_)));
        assert!(Redactor::new(&SecretEnv::new()).is_empty());
        assert!(!format!("{r:?}").contains("sk-"));
    }
}
