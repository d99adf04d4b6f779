//! What the writer does to an event's data before it is queued: every U+0000 (which
//! PostgreSQL's `jsonb` refuses) becomes U+FFFD, in string values and in object keys, and
//! the data's approximate stored size is measured on the same walk. It runs once per event
//! on the producer's task; data without a NUL is never copied.

use serde_json::{Map, Value};

/// What a NUL becomes in stored and streamed event data.
pub const REPLACEMENT: char = '\u{FFFD}';

/// Approximate bytes an event costs besides its data (ids, seq, kind, time, framing).
pub const ENVELOPE_BYTES: usize = 96;

/// Replace every U+0000 in `value` by U+FFFD; returns the approximate size of the value as
/// JSON text, in bytes.
pub fn scrub(value: &mut Value) -> usize {
    match value {
        Value::Null => 4,
        Value::Bool(_) => 5,
        Value::Number(_) => 8,
        Value::String(s) => scrub_text(s) + 2,
        Value::Array(items) => items.iter_mut().map(|v| scrub(v) + 1).sum::<usize>() + 2,
        Value::Object(map) => scrub_object(map) + 2,
    }
}

/// Replace every U+0000 in `s` by U+FFFD; returns its length in bytes.
pub fn scrub_text(s: &mut String) -> usize {
    if s.as_bytes().contains(&0) {
        *s = s.replace('\0', "\u{FFFD}");
    }
    s.len()
}

fn scrub_object(map: &mut Map<String, Value>) -> usize {
    // Keys with a NUL are rare: rename them only when one is there.
    if map.keys().any(|k| k.as_bytes().contains(&0)) {
        let old = std::mem::take(map);
        for (mut k, v) in old {
            scrub_text(&mut k);
            // Two keys that differ only by NUL versus U+FFFD: the later one wins, as in
            // any JSON object with a repeated key.
            map.insert(k, v);
        }
    }
    map.iter_mut()
        .map(|(k, v)| k.len() + 4 + scrub(v))
        .sum::<usize>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nul_in_strings_and_keys_becomes_the_replacement_character() {
        let mut v = json!({
            "text": "a\u{0}b\u{0}",
            "nested": [{"k\u{0}ey": "x"}, "\u{0}", 3, null, true],
            "clean": "no change"
        });
        scrub(&mut v);
        assert_eq!(
            v,
            json!({
                "text": "a\u{FFFD}b\u{FFFD}",
                "nested": [{"k\u{FFFD}ey": "x"}, "\u{FFFD}", 3, null, true],
                "clean": "no change"
            })
        );
        assert!(!serde_json::to_string(&v).unwrap().contains("\\u0000"));
    }

    #[test]
    fn clean_data_is_left_alone_and_measured() {
        let mut v = json!({"message_id": "msg_1", "text": "hello"});
        let before = v.clone();
        let size = scrub(&mut v);
        assert_eq!(v, before);
        let exact = serde_json::to_string(&v).unwrap().len();
        // Approximate, but of the right size: within a few bytes per value.
        assert!(size >= exact && size <= exact + 16, "{size} vs {exact}");
    }

    #[test]
    fn size_grows_with_the_text() {
        let mut small = json!({"text": "x"});
        let mut big = json!({"text": "x".repeat(100_000)});
        assert!(scrub(&mut big) >= scrub(&mut small) + 99_999);
    }

    #[test]
    fn a_clean_string_is_not_reallocated() {
        let mut v = Value::String("plain text".into());
        let ptr = v.as_str().unwrap().as_ptr();
        scrub(&mut v);
        assert_eq!(v.as_str().unwrap().as_ptr(), ptr);
    }
}
