//! Repository setup scripts: a project may commit `.agentry.toml` on its base branch,
//!
//! ```toml
//! [worktree]
//! setup = [["npm", "ci"], ["cp", ".env.example", ".env"]]
//! teardown = [["docker", "compose", "down"]]
//! ```
//!
//! Setup commands run in each new worktree, one after the other, stopping at the first
//! failure; teardown commands run before the worktree is removed. The file is read from
//! the commit the worktree starts at (never from the worktree, which an agent may have
//! changed). Each command is an argv run through the process ledger with the minimal
//! environment plus `AGENTRY_*` facts about the workspace — no shell, no team secrets —
//! in the sandbox an agent of the workspace gets; under the `proxy` network mode the run
//! has an egress endpoint of its own (the server's and the team's entries), and each
//! connection it refuses is a line of the output and a `network_denied` team event.
//! Progress goes out as team events (`workspace_setup` / `workspace_teardown`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::time::Instant;

use super::{ServiceContext, ServiceResult};
use crate::domain::WorkspaceId;
use crate::egress::{CommandsEndpoint, Denial};
use crate::events::NewTeamEvent;
use crate::git;
use crate::process::{CommandSpec, Ledger};
use crate::store;

/// The file, at the root of the repository.
pub const FILE: &str = ".agentry.toml";
/// Larger files are refused (the setup fails and says so).
const MAX_FILE_BYTES: u64 = 64 * 1024;
const MAX_COMMANDS: usize = 32;
const MAX_ARG_BYTES: usize = 4096;
/// Output kept (the end of it) in the workspace and in the final event.
const OUTPUT_KEPT: usize = 64 * 1024;
/// How often new output goes out while commands run.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// TERM → KILL grace for a command that ran out of time.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// After a command exits, how long its output pipes may stay open (held by a process it
/// left behind) before the rest of its group is stopped.
const DRAIN: Duration = Duration::from_secs(1);

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RepoFile {
    #[serde(default)]
    worktree: Scripts,
}

/// The `[worktree]` table.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Scripts {
    #[serde(default)]
    pub setup: Vec<Vec<String>>,
    #[serde(default)]
    pub teardown: Vec<Vec<String>>,
}

/// What the committed file says, if anything.
#[derive(Debug, Clone, PartialEq)]
pub enum RepoScripts {
    /// No file, or one without commands for this phase.
    None,
    Found(Scripts),
    /// The file exists but cannot be used; the setup fails with this message.
    Invalid(String),
}

impl RepoScripts {
    /// Whether a new worktree has setup to run (an unusable file counts: its setup fails).
    pub fn has_setup(&self) -> bool {
        match self {
            RepoScripts::None => false,
            RepoScripts::Found(s) => !s.setup.is_empty(),
            RepoScripts::Invalid(_) => true,
        }
    }
}

/// When the commands run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Setup,
    Teardown,
}

impl Phase {
    fn event_kind(self) -> &'static str {
        match self {
            Phase::Setup => "workspace_setup",
            Phase::Teardown => "workspace_teardown",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::Teardown => "teardown",
        }
    }
}

/// Parse and check the file's text.
pub fn parse(text: &[u8]) -> Result<Scripts, String> {
    let text = std::str::from_utf8(text).map_err(|_| format!("{FILE} is not UTF-8"))?;
    let file: RepoFile = toml::from_str(text).map_err(|e| format!("{FILE}: {e}"))?;
    for (name, list) in [
        ("setup", &file.worktree.setup),
        ("teardown", &file.worktree.teardown),
    ] {
        if list.len() > MAX_COMMANDS {
            return Err(format!(
                "{FILE}: worktree.{name} has {} commands, at most {MAX_COMMANDS} are allowed",
                list.len()
            ));
        }
        for (i, argv) in list.iter().enumerate() {
            let Some(program) = argv.first() else {
                return Err(format!("{FILE}: worktree.{name}[{i}] is an empty command"));
            };
            if program.is_empty() {
                return Err(format!(
                    "{FILE}: worktree.{name}[{i}] has an empty program name"
                ));
            }
            if argv
                .iter()
                .any(|a| a.contains('\0') || a.len() > MAX_ARG_BYTES)
            {
                return Err(format!(
                    "{FILE}: worktree.{name}[{i}] has an argument with U+0000 or longer than {MAX_ARG_BYTES} bytes"
                ));
            }
        }
    }
    Ok(file.worktree)
}

/// Read `.agentry.toml` from `commit` of `repo`.
#[tracing::instrument(name = "services::setup::read", skip_all)]
pub async fn read(repo: &Path, commit: &str) -> RepoScripts {
    match git::read_committed_file(repo, commit, FILE, MAX_FILE_BYTES).await {
        Ok(None) => RepoScripts::None,
        Ok(Some(bytes)) => match parse(&bytes) {
            Ok(s) if s.setup.is_empty() && s.teardown.is_empty() => RepoScripts::None,
            Ok(s) => RepoScripts::Found(s),
            Err(e) => RepoScripts::Invalid(e),
        },
        Err(e) => RepoScripts::Invalid(format!("could not read {FILE}: {e}")),
    }
}

/// The workspace the commands run in.
#[derive(Debug, Clone)]
pub struct Target {
    pub workspace_id: WorkspaceId,
    pub team_id: uuid::Uuid,
    pub project_id: uuid::Uuid,
    pub path: std::path::PathBuf,
    pub branch: Option<String>,
    pub base_commit: Option<String>,
}

/// How a run ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub succeeded: bool,
    pub output: String,
}

/// Run the setup of a new worktree to its end, record the outcome on the workspace and
/// announce it. `scripts` is what [`read`] found.
#[tracing::instrument(name = "services::setup::run_setup", skip_all)]
pub async fn run_setup(
    ctx: &ServiceContext,
    target: &Target,
    scripts: RepoScripts,
) -> ServiceResult<Option<store::workspaces::WorkspaceRow>> {
    let timeout = Duration::from_secs(ctx.repos.workspaces.setup_timeout_s);
    let outcome = match scripts {
        _ if !scripts.has_setup() => return Ok(None),
        RepoScripts::None => return Ok(None),
        RepoScripts::Invalid(why) => {
            let output = format!("{why}\n");
            announce(ctx, target, Phase::Setup, "running", &output).await;
            Outcome {
                succeeded: false,
                output,
            }
        }
        RepoScripts::Found(s) => run(ctx, target, Phase::Setup, &s.setup, timeout).await,
    };
    // The workspace is complete now: `workspace.create.after` is queued with its outcome,
    // in the same transaction.
    let row = super::within_deadline(&ctx.data, async {
        let mut tx = ctx.data.pool.pool().begin().await?;
        let row = store::workspaces::finish_setup(
            &mut *tx,
            target.workspace_id.uuid(),
            outcome.succeeded,
            &outcome.output,
        )
        .await?;
        let queued = match &row {
            Some(row) => super::workspaces::queue_created(&mut tx, row).await?,
            None => 0,
        };
        tx.commit().await?;
        if queued > 0 {
            ctx.hooks.queued();
        }
        Ok(row)
    })
    .await?;
    let status = if outcome.succeeded {
        "succeeded"
    } else {
        "failed"
    };
    announce(ctx, target, Phase::Setup, status, &outcome.output).await;
    Ok(row)
}

/// Run the teardown commands, if the file has any; the archive goes on whatever they do.
#[tracing::instrument(name = "services::setup::run_teardown", skip_all)]
pub async fn run_teardown(ctx: &ServiceContext, target: &Target, repo: &Path) {
    let Some(commit) = &target.base_commit else {
        return;
    };
    let scripts = match read(repo, commit).await {
        RepoScripts::Found(s) if !s.teardown.is_empty() => s,
        RepoScripts::Invalid(why) => {
            tracing::warn!(workspace = %target.workspace_id, error = %why, "teardown skipped");
            announce(ctx, target, Phase::Teardown, "failed", &format!("{why}\n")).await;
            return;
        }
        _ => return,
    };
    let timeout = Duration::from_secs(ctx.repos.workspaces.teardown_timeout_s);
    let outcome = run(ctx, target, Phase::Teardown, &scripts.teardown, timeout).await;
    let status = if outcome.succeeded {
        "succeeded"
    } else {
        "failed"
    };
    announce(ctx, target, Phase::Teardown, status, &outcome.output).await;
}

/// Fail the setups this replica left running when it stopped, and say so.
#[tracing::instrument(name = "services::setup::fail_interrupted", skip_all)]
pub async fn fail_interrupted(ctx: &ServiceContext, replica: &str) -> ServiceResult<()> {
    let note = "\n[agentry] the server stopped while setup was running\n";
    // These workspaces are complete now (setup failed): `workspace.create.after` is queued
    // for each, in the same transaction.
    let mut tx = ctx.data.pool.pool().begin().await?;
    let rows = store::workspaces::fail_interrupted_setups(&mut *tx, replica, note).await?;
    let mut queued = 0;
    for row in &rows {
        queued += super::workspaces::queue_created(&mut tx, row).await?;
    }
    tx.commit().await?;
    if queued > 0 {
        ctx.hooks.queued();
    }
    for row in rows {
        let target = Target {
            workspace_id: row.id.into(),
            team_id: row.team_id,
            project_id: row.project_id,
            path: row.path.clone().into(),
            branch: row.branch.clone(),
            base_commit: row.base_commit.clone(),
        };
        let output = row.setup_output.clone().unwrap_or_default();
        announce(ctx, &target, Phase::Setup, "failed", &output).await;
    }
    Ok(())
}

/// Progress on the team stream; losing one (the database is down) does not stop the
/// commands, whose outcome is also stored on the workspace.
async fn announce(ctx: &ServiceContext, target: &Target, phase: Phase, status: &str, output: &str) {
    let event = NewTeamEvent {
        team_id: target.team_id,
        project_id: Some(target.project_id),
        workspace_id: Some(target.workspace_id.uuid()),
        kind: phase.event_kind(),
        data: json!({"workspace_id": target.workspace_id, "status": status, "output": output}),
    };
    if let Err(e) = super::announce(&ctx.data, event).await {
        tracing::warn!(workspace = %target.workspace_id, error = %e, "could not announce {} progress", phase.name());
    }
}

/// The output of a run: everything for the end (its last [`OUTPUT_KEPT`] bytes) and what
/// is new since the last progress event.
#[derive(Default)]
struct Output {
    kept: String,
    dropped: bool,
    fresh: String,
}

impl Output {
    fn push(&mut self, text: &str) {
        self.kept.push_str(text);
        self.fresh.push_str(text);
        for buf in [&mut self.kept, &mut self.fresh] {
            if buf.len() > OUTPUT_KEPT {
                let mut cut = buf.len() - OUTPUT_KEPT;
                while !buf.is_char_boundary(cut) {
                    cut += 1;
                }
                buf.drain(..cut);
            }
        }
        if self.kept.len() >= OUTPUT_KEPT {
            self.dropped = true;
        }
    }

    fn take_fresh(&mut self) -> String {
        std::mem::take(&mut self.fresh)
    }

    fn finish(&self) -> String {
        if self.dropped {
            format!("[agentry] earlier output dropped\n{}", self.kept)
        } else {
            self.kept.clone()
        }
    }
}

type Shared = Arc<Mutex<Output>>;

fn push(out: &Shared, text: &str) {
    out.lock().unwrap_or_else(|p| p.into_inner()).push(text);
}

/// Run `commands` one after the other in the workspace until one fails or time runs out.
async fn run(
    ctx: &ServiceContext,
    target: &Target,
    phase: Phase,
    commands: &[Vec<String>],
    timeout: Duration,
) -> Outcome {
    let out: Shared = Arc::default();
    announce(ctx, target, phase, "running", "").await;
    // Open for the whole run, closed when it ends (dropped), however it ends.
    let mut endpoint = match open_endpoint(ctx, target).await {
        Ok(e) => e,
        Err(why) => {
            push(&out, &format!("[agentry] {why}\n"));
            let output = out.lock().unwrap_or_else(|p| p.into_inner()).finish();
            return Outcome {
                succeeded: false,
                output,
            };
        }
    };
    let network = endpoint
        .as_ref()
        .map(|e| crate::sandbox::NetworkPlan::from(e.net.clone()));
    let deadline = Instant::now() + timeout;
    let ledger = ctx.fleet.agents.ledger().clone();
    let sandbox = ctx.fleet.agents.sandbox().cloned();
    let commands = commands.to_vec();
    let target_env = environment(target);
    let cwd = target.path.clone();
    let work_out = out.clone();
    let mut work = tokio::spawn(async move {
        for argv in &commands {
            push(&work_out, &format!("$ {}\n", display_argv(argv)));
            let spec = CommandSpec {
                env: target_env.clone(),
                ..CommandSpec::new(argv[0].clone(), argv[1..].to_vec(), cwd.clone())
            };
            // The repository's commands run in the sandbox an agent of the workspace gets.
            let spec = match &sandbox {
                Some(sandbox) => {
                    let view = crate::sandbox::AgentView {
                        agent: None,
                        worktree: cwd.clone(),
                        provider: None,
                        // Under `proxy`: the run's endpoint; else the settings' mode.
                        network: network.clone(),
                    };
                    match sandbox.wrap(spec, &view) {
                        Ok(spec) => spec,
                        Err(e) => {
                            push(&work_out, &format!("[agentry] {e}\n"));
                            return false;
                        }
                    }
                }
                None => spec,
            };
            if let Err(why) = run_one(&ledger, &spec, &work_out, deadline, timeout).await {
                push(&work_out, &format!("[agentry] {why}\n"));
                return false;
            }
        }
        true
    });
    let mut tick = tokio::time::interval(PROGRESS_EVERY);
    tick.tick().await;
    let succeeded = loop {
        tokio::select! {
            done = &mut work => break done.unwrap_or(false),
            _ = tick.tick() => {
                let fresh = out.lock().unwrap_or_else(|p| p.into_inner()).take_fresh();
                if !fresh.is_empty() {
                    announce(ctx, target, phase, "running", &fresh).await;
                }
            }
            Some(denial) = next_denial(&mut endpoint) => {
                record_denial(ctx, target, phase, &out, denial).await;
            }
        }
    };
    // A refusal is reported before its `403` is written: the last ones are here already.
    while let Some(denial) = endpoint.as_mut().and_then(|e| e.denials.try_recv().ok()) {
        record_denial(ctx, target, phase, &out, denial).await;
    }
    drop(endpoint);
    let output = out.lock().unwrap_or_else(|p| p.into_inner()).finish();
    Outcome { succeeded, output }
}

/// Under the `proxy` network mode, an egress endpoint for one run with the server's and
/// the team's entries, as they are now (no provider's: none runs the commands); `None`
/// in the other modes. `Err` says why the run fails.
async fn open_endpoint(
    ctx: &ServiceContext,
    target: &Target,
) -> Result<Option<CommandsEndpoint>, String> {
    let Some(egress) = ctx.fleet.agents.egress() else {
        return Ok(None);
    };
    let allow =
        super::network::commands_allow_list(&ctx.data, &ctx.fleet.egress_policy, target.team_id)
            .await
            .map_err(|e| format!("could not read the team's network allow list: {e}"))?;
    egress
        .open_for_commands(allow)
        .map(Some)
        .map_err(|e| format!("could not open the commands' egress endpoint: {e}"))
}

/// The run's next refused connection; never, without an endpoint.
async fn next_denial(endpoint: &mut Option<CommandsEndpoint>) -> Option<Denial> {
    match endpoint {
        Some(e) => e.denials.recv().await,
        None => std::future::pending().await,
    }
}

/// A connection the proxy refused the commands: a line of their output (kept on the
/// workspace) and a `network_denied` team event, shaped as an agent's with the workspace
/// and the phase added.
async fn record_denial(
    ctx: &ServiceContext,
    target: &Target,
    phase: Phase,
    out: &Shared,
    denial: Denial,
) {
    let Denial {
        host, port, reason, ..
    } = denial;
    let shown = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    push(
        out,
        &format!("[agentry] network_denied: {shown} ({})\n", reason.as_str()),
    );
    let event = NewTeamEvent {
        team_id: target.team_id,
        project_id: Some(target.project_id),
        workspace_id: Some(target.workspace_id.uuid()),
        kind: "network_denied",
        data: json!({
            "workspace_id": target.workspace_id,
            "phase": phase.name(),
            "host": host,
            "port": port,
            "reason": reason.as_str(),
        }),
    };
    if let Err(e) = super::announce(&ctx.data, event).await {
        tracing::warn!(workspace = %target.workspace_id, error = %e, "could not announce a refused connection");
    }
}

/// The program a command names, also once wrapped in a sandbox (and its bridge).
fn shown_program(spec: &CommandSpec) -> &str {
    spec.wraps.as_deref().unwrap_or(&spec.program)
}

/// One command to its end: `Err` says why it counts as failed.
async fn run_one(
    ledger: &Ledger,
    spec: &CommandSpec,
    out: &Shared,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), String> {
    let mut child = ledger
        .launch_limited(spec, None)
        .await
        .map_err(|e| e.to_string())?;
    drop(child.take_stdin());
    let readers = [
        child.take_stdout().map(|s| drain(s, out.clone())),
        child.take_stderr().map(|s| drain(s, out.clone())),
    ];
    let status = match tokio::time::timeout_at(deadline, child.wait()).await {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => {
            child.terminate(STOP_GRACE).await;
            return Err(format!("could not wait for `{}`: {e}", shown_program(spec)));
        }
        Err(_) => {
            child.terminate(STOP_GRACE).await;
            for r in readers.into_iter().flatten() {
                let _ = tokio::time::timeout(DRAIN, r).await;
            }
            return Err(format!("timed out after {} s", timeout.as_secs()));
        }
    };
    for r in readers.into_iter().flatten() {
        let _ = tokio::time::timeout(DRAIN, r).await;
    }
    // Whatever it left running in its group ends with it.
    child.terminate(STOP_GRACE).await;
    if let Some(hit) = child.limit_hit() {
        return Err(format!("`{}` was stopped: {hit}", shown_program(spec)));
    }
    if status.success() {
        Ok(())
    } else {
        Err(
            crate::process::output::describe_exit(Some(status), None, "")
                .replace("the agent process", &format!("`{}`", shown_program(spec))),
        )
    }
}

/// Read a pipe to its end into the output, as UTF-8 (invalid bytes become U+FFFD; a
/// character split between two reads is kept whole).
fn drain<R>(mut pipe: R, out: Shared) -> tokio::task::JoinHandle<()>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut buf = vec![0u8; 8192];
        let mut carry: Vec<u8> = Vec::new();
        loop {
            match pipe.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    carry.extend_from_slice(&buf[..n]);
                    let text = decode(&mut carry);
                    if !text.is_empty() {
                        push(&out, &text);
                    }
                }
            }
        }
        if !carry.is_empty() {
            push(
                &out,
                &String::from_utf8_lossy(&carry).replace('\0', "\u{FFFD}"),
            );
        }
    })
}

/// The text of `bytes` up to the last complete character; an incomplete character at
/// the end stays in `bytes` for the next read. U+0000 becomes U+FFFD.
fn decode(bytes: &mut Vec<u8>) -> String {
    let keep = match std::str::from_utf8(bytes) {
        Ok(_) => 0,
        Err(e) if e.error_len().is_none() => bytes.len() - e.valid_up_to(),
        Err(_) => 0,
    };
    let rest = bytes.split_off(bytes.len() - keep);
    let text = String::from_utf8_lossy(bytes).replace('\0', "\u{FFFD}");
    *bytes = rest;
    text
}

/// What the commands learn about their workspace.
fn environment(target: &Target) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert(
        "AGENTRY_WORKSPACE_ID".into(),
        target.workspace_id.to_string(),
    );
    env.insert(
        "AGENTRY_WORKSPACE_PATH".into(),
        target.path.to_string_lossy().into_owned(),
    );
    if let Some(b) = &target.branch {
        env.insert("AGENTRY_BRANCH".into(), b.clone());
    }
    if let Some(c) = &target.base_commit {
        env.insert("AGENTRY_BASE_COMMIT".into(), c.clone());
    }
    env
}

/// An argv as a reader would type it (each argument quoted when it needs to be).
fn display_argv(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:@,+%".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_names_setup_and_teardown_argvs() {
        let s = parse(
            br#"[worktree]
setup = [["npm", "ci"], ["cp", ".env.example", ".env"]]
teardown = [["make", "clean"]]
"#,
        )
        .unwrap();
        assert_eq!(
            s.setup,
            vec![vec!["npm", "ci"], vec!["cp", ".env.example", ".env"]]
        );
        assert_eq!(s.teardown, vec![vec!["make", "clean"]]);
    }

    #[test]
    fn unknown_keys_and_empty_commands_are_refused() {
        let e = parse(b"[worktree]\nsetup = [[\"a\"]]\nbefore = []\n").unwrap_err();
        assert!(e.contains("before"), "{e}");
        let e = parse(b"[worktree]\nsetup = [[]]\n").unwrap_err();
        assert!(e.contains("empty command"), "{e}");
        let e = parse(b"[worktree]\nsetup = \"npm ci\"\n").unwrap_err();
        assert!(e.contains(FILE), "{e}");
        let e = parse(b"[other]\n").unwrap_err();
        assert!(e.contains("other"), "{e}");
        assert_eq!(parse(b"").unwrap(), Scripts::default());
    }

    #[test]
    fn a_split_character_waits_for_its_last_byte() {
        let mut bytes = "é".as_bytes()[..1].to_vec();
        assert_eq!(decode(&mut bytes), "");
        bytes.push("é".as_bytes()[1]);
        assert_eq!(decode(&mut bytes), "é");
        let mut bytes = b"a\0b\xff".to_vec();
        assert_eq!(decode(&mut bytes), "a\u{FFFD}b\u{FFFD}");
        assert!(bytes.is_empty());
    }

    #[test]
    fn output_keeps_its_end() {
        let mut o = Output::default();
        o.push(&"x".repeat(OUTPUT_KEPT));
        o.push("tail\n");
        let all = o.finish();
        assert!(all.starts_with("[agentry] earlier output dropped\n"));
        assert!(all.ends_with("tail\n"));
        assert!(o.take_fresh().len() <= OUTPUT_KEPT);
    }

    #[test]
    fn argvs_display_quoted_where_needed() {
        assert_eq!(
            display_argv(&["sh".into(), "-c".into(), "echo it's".into()]),
            r"sh -c 'echo it'\''s'"
        );
    }
}
