//! Layers point one way: a module may use modules of its own layer and of the layers
//! below it, never one above. This reads every file under `src/` and checks each
//! `crate::<module>` path (including `use crate::{a, b}` groups) against the map below,
//! which docs/architecture.md describes, and that nothing below the HTTP edge names actix.
//! A module declared in lib.rs but missing from the map fails the test too, so a new
//! module gets a place on purpose.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Highest first. Modules in one layer may use each other.
const LAYERS: &[&[&str]] = &[
    // Commands beside the server that build a whole application.
    &["bench", "cli", "client"],
    // The wiring of the application: builds the state, the HTTP server and its tasks.
    &["server"],
    // The HTTP edge: handlers and the state they read.
    &["api"],
    &["services"],
    &["auth", "runtime"],
    &["providers", "embedded_pg"],
    &["process", "git", "egress", "sandbox", "forge"],
    &["events"],
    &["store"],
    &["domain"],
];

/// The HTTP framework may be named only at and above this layer (the HTTP edge).
const HTTP_EDGE: usize = 2;

/// Utilities every layer may use; they use nothing but each other.
const LEAVES: &[&str] = &["config", "event_stream", "metrics", "telemetry"];

fn rank(module: &str) -> Option<usize> {
    if LEAVES.contains(&module) {
        return Some(LAYERS.len());
    }
    LAYERS.iter().position(|layer| layer.contains(&module))
}

/// `module` may use `target`.
fn allowed(module: &str, target: &str) -> bool {
    if module == target {
        return true;
    }
    match (rank(module), rank(target)) {
        // A leaf uses only leaves.
        (Some(m), Some(t)) if m == LAYERS.len() => t == LAYERS.len(),
        // Lower rank number = higher layer; a module uses its own layer and those below.
        (Some(m), Some(t)) => t >= m,
        _ => false,
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src/") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`src/api/sse.rs` → `api`), when it is one of
/// the crate's modules (`modules`, declared in lib.rs).
fn module_of(src: &Path, file: &Path, modules: &BTreeSet<String>) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    modules.contains(name).then(|| name.to_owned())
}

/// The modules lib.rs declares (`pub mod x;`, `mod x;`).
fn declared_modules(lib: &str) -> BTreeSet<String> {
    lib.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let name = l.strip_prefix("mod ")?.strip_suffix(';')?;
            Some(name.trim().to_owned())
        })
        .collect()
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// Every top-level module named by a `crate::` path in `code` (comments removed).
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in code.lines() {
        let line = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            let preceded_by_ident = rest[..i]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            rest = &rest[i + "crate::".len()..];
            if preceded_by_ident {
                continue;
            }
            if let Some(group) = rest.strip_prefix('{') {
                out.extend(group_heads(code_after(code, line, group)));
            } else {
                let name = ident(rest);
                if !name.is_empty() {
                    out.insert(name.to_owned());
                }
            }
        }
    }
    out
}

/// The text of a `use crate::{…}` group, which may span lines: from `group` (a suffix of
/// `line`) to the end of the file; `group_heads` stops at the closing brace.
fn code_after<'a>(code: &'a str, line: &str, group: &str) -> &'a str {
    let line_start = line.as_ptr() as usize - code.as_ptr() as usize;
    let offset = line_start + (line.len() - group.len());
    &code[offset..]
}

/// The first identifier of every item of a `{a, b::c, d::{e}}` group.
fn group_heads(text: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0usize;
    let mut item_start = true;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => item_start = true,
            c if item_start && (c.is_ascii_alphabetic() || c == '_') => {
                let name = ident(&text[i..]);
                if name != "self" {
                    heads.push(name.to_owned());
                }
                item_start = false;
                for _ in 1..name.len() {
                    chars.next();
                }
            }
            _ => {}
        }
    }
    heads
}

/// Whether `code` (comments aside) names the HTTP framework.
fn names_http_framework(code: &str) -> bool {
    code.lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .any(|l| l.contains("actix_web") || l.contains("actix::") || l.contains("actix_web_lab"))
}

#[test]
fn no_layer_uses_a_layer_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    assert!(
        files.len() > 10,
        "found only {} files under src/",
        files.len()
    );
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("read src/lib.rs");
    let modules = declared_modules(&lib);
    assert!(
        modules.contains("api") && modules.contains("domain"),
        "{modules:?}"
    );
    let mut unmapped: BTreeSet<String> = modules
        .iter()
        .filter(|m| rank(m).is_none())
        .cloned()
        .collect();
    let mut violations = Vec::new();
    for file in &files {
        let Some(module) = module_of(&src, file, &modules) else {
            continue;
        };
        if rank(&module).is_none() {
            continue;
        }
        let code = std::fs::read_to_string(file).expect("read source file");
        if rank(&module).is_some_and(|r| r > HTTP_EDGE) && names_http_framework(&code) {
            violations.push(format!(
                "{}: `{module}` is below the HTTP edge but uses actix",
                file.strip_prefix(&src).unwrap_or(file).display()
            ));
        }
        for target in crate_paths(&code) {
            if rank(&target).is_none() {
                unmapped.insert(target.clone());
            } else if !allowed(&module, &target) {
                violations.push(format!(
                    "{}: `{module}` uses `crate::{target}`, a layer above it",
                    file.strip_prefix(&src).unwrap_or(file).display()
                ));
            }
        }
    }
    assert!(
        unmapped.is_empty(),
        "modules missing from the layer map in tests/layers.rs (and docs/architecture.md): {unmapped:?}"
    );
    assert!(
        violations.is_empty(),
        "layers must point one way:\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_checker_sees_every_form_of_path() {
    let code = "use crate::api::error::ApiError;\n\
                use crate::{server::AppState,\n    store, domain::{AgentId, TurnId}};\n\
                fn f() { crate::runtime::x(); }\n\
                // crate::bench is only mentioned in a comment\n\
                use other_crate::thing;\n";
    let found: Vec<String> = crate_paths(code).into_iter().collect();
    assert_eq!(found, ["api", "domain", "runtime", "server", "store"]);
    assert!(allowed("api", "services"));
    assert!(!allowed("api", "server"));
    assert!(allowed("server", "api"));
    assert!(!allowed("services", "api"));
    assert!(!allowed("services", "server"));
    assert!(!allowed("auth", "api"));
    assert!(!allowed("store", "events"));
    assert!(allowed("events", "store"));
    assert!(allowed("providers", "config"));
    assert!(!allowed("config", "store"));
    assert!(!allowed("unknown", "domain"));
    assert!(names_http_framework("use actix_web::HttpRequest;"));
    assert!(!names_http_framework("// actix_web is for api/ only"));
}
