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
}
