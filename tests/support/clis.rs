//! The pinned agent CLIs (`.ci/cli-pins`), as `.ci/install-clis` installs them into
//! `~/.cache/agentry/clis/` (or `$AGENTRY_CLI_CACHE`).
//!
//! A test that needs one calls `cli("claude")`. When it is not installed the test fails,
//! saying how to install it: a test that did not run never reports `ok`. `.ci/test` (the
//! README's test command) installs every peer before it runs the tests.

use std::path::PathBuf;

const PINS: &str = include_str!("../../.ci/cli-pins");

/// The installed binary of the pinned CLI named `bin` (`claude`, `codex`).
pub fn cli(bin: &str) -> PathBuf {
    let (spec, _) = PINS
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(' '))
        .find(|(_, b)| b.trim() == bin)
        .unwrap_or_else(|| panic!("`{bin}` is not pinned in .ci/cli-pins"));
    let cache = std::env::var_os("AGENTRY_CLI_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                .join(".cache/agentry/clis")
        });
    let path = cache
        .join(spec.replace('/', "+"))
        .join("node_modules/.bin")
        .join(bin);
    assert!(
        path.exists(),
        "{spec} is not installed at {}; run the tests with .ci/test, which installs it \
         (or run .ci/install-clis)",
        path.display()
    );
    path
}
