//! Repositories the server clones from a remote over http(s): a bare clone it alone
//! writes, refreshed by a fetch before each new workspace.
//!
//! The remote's branches land under `refs/remotes/origin/*` (so a fetch never touches the
//! branches of the server's worktrees) and its tags under `refs/tags/*`. Every command
//! talks only http or https, follows no redirect, runs no hook, asks no terminal and no
//! credential helper, and reads no system or global config. The credential, when there
//! is one, reaches git as an `http.extraHeader` through `GIT_CONFIG_*` variables of the
//! child's environment: never in argv, a config file, the repository or an error.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tokio::process::Command;

use super::{GitError, at, command, run, stdout_line};
use crate::domain::SecretValue;

/// The namespace the remote's branches are fetched into.
pub const REMOTE_BRANCHES: &str = "refs/remotes/origin/";

/// Environment variables that would make git print request headers or run a program to
/// ask for a password.
const SCRUBBED_REMOTE_ENV: &[&str] = &[
    "GIT_TRACE",
    "GIT_TRACE_CURL",
    "GIT_TRACE_CURL_NO_DATA",
    "GIT_TRACE_PACKET",
    "GIT_TRACE_REDACT",
    "GIT_CURL_VERBOSE",
    "GIT_ASKPASS",
    "SSH_ASKPASS",
    "GIT_SSH",
    "GIT_SSH_COMMAND",
    "GIT_PROXY_COMMAND",
    "GIT_EXEC_PATH",
];

/// How to reach one remote: its URL (http or https, without user info), the addresses
/// its host was checked at (pinned, so a second DNS answer cannot send git elsewhere),
/// and the credential.
pub struct Remote<'a> {
    pub url: &'a str,
    /// `host:port` and the addresses to use for it; empty for an address literal.
    pub pinned: Option<(String, u16, Vec<SocketAddr>)>,
    pub credential: Option<&'a SecretValue>,
    pub timeout: Duration,
}

impl Remote<'_> {
    /// The `Authorization` header the credential makes: `user:password` is sent as
    /// Basic, anything else as a Bearer token.
    fn authorization(&self) -> Option<String> {
        use base64::Engine;
        let value = self.credential?.expose();
        Some(if value.contains(':') {
            format!(
                "Authorization: Basic {}",
                base64::engine::general_purpose::STANDARD.encode(value)
            )
        } else {
            format!("Authorization: Bearer {value}")
        })
    }

    /// Removes the credential (and its encodings) from text git printed.
    fn scrub(&self, text: &str) -> String {
        let Some(secret) = self.credential.map(SecretValue::expose) else {
            return text.to_owned();
        };
        let mut out = text.to_owned();
        if let Some(header) = self.authorization() {
            let encoded = header.rsplit(' ').next().unwrap_or_default().to_owned();
            if !encoded.is_empty() {
                out = out.replace(&encoded, "[redacted]");
            }
        }
        if !secret.is_empty() {
            out = out.replace(secret, "[redacted]");
            for part in secret.split(':').filter(|p| p.len() >= 4) {
                out = out.replace(part, "[redacted]");
            }
        }
        out
    }

    /// A git command on the bare repository `git_dir` that may talk to this remote.
    fn command(&self, git_dir: &Path) -> Command {
        let mut cmd = at(git_dir);
        for var in SCRUBBED_REMOTE_ENV {
            cmd.env_remove(var);
        }
        let mut config: Vec<(&str, String)> = vec![
            ("protocol.allow", "never".into()),
            ("protocol.http.allow", "always".into()),
            ("protocol.https.allow", "always".into()),
            ("http.followRedirects", "false".into()),
            // An empty value clears every helper configured anywhere else.
            ("credential.helper", String::new()),
            ("core.askPass", String::new()),
            ("core.hooksPath", "/dev/null".into()),
            ("transfer.fsckObjects", "true".into()),
            // A remote that stops sending is dropped well before the overall bound.
            ("http.lowSpeedLimit", "1".into()),
            (
                "http.lowSpeedTime",
                self.timeout.as_secs().clamp(1, 60).to_string(),
            ),
        ];
        if let Some((host, port, addrs)) = &self.pinned {
            let list: Vec<String> = addrs
                .iter()
                .map(|a| match a {
                    SocketAddr::V4(v4) => v4.ip().to_string(),
                    SocketAddr::V6(v6) => format!("[{}]", v6.ip()),
                })
                .collect();
            config.push((
                "http.curloptResolve",
                format!("{host}:{port}:{}", list.join(",")),
            ));
        }
        if let Some(header) = self.authorization() {
            config.push(("http.extraHeader", header));
        }
        cmd.env("GIT_CONFIG_COUNT", config.len().to_string());
        for (i, (key, value)) in config.into_iter().enumerate() {
            cmd.env(format!("GIT_CONFIG_KEY_{i}"), key);
            cmd.env(format!("GIT_CONFIG_VALUE_{i}"), value);
        }
        cmd.env("GIT_ALLOW_PROTOCOL", "http:https")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_TERMINAL_PROMPT", "0");
        cmd
    }

    /// Runs `cmd` within the timeout; a failure's message carries no credential.
    async fn run_ok(&self, cmd: Command, what: &str) -> Result<Vec<u8>, GitError> {
        let out = match tokio::time::timeout(self.timeout, run(cmd)).await {
            Ok(out) => out?,
            Err(_) => {
                return Err(GitError::Failed(format!(
                    "git {what}: no answer within {} s",
                    self.timeout.as_secs()
                )));
            }
        };
        if out.status.success() {
            return Ok(out.stdout);
        }
        let stderr = self.scrub(String::from_utf8_lossy(&out.stderr).trim());
        tracing::debug!(command = what, status = %out.status, stderr, "git command failed");
        Err(GitError::Failed(if stderr.is_empty() {
            format!("git {what}: {}", out.status)
        } else {
            format!("git {what}: {stderr}")
        }))
    }
}

/// The branch the remote's `HEAD` names, `None` when it has no branch at all.
async fn remote_head(remote: &Remote<'_>, dir: &Path) -> Result<Option<String>, GitError> {
    let mut cmd = remote.command(dir);
    cmd.args(["ls-remote", "--symref", "--end-of-options", remote.url])
        .args(["HEAD", "refs/heads/*"]);
    let out = remote.run_ok(cmd, "ls-remote").await?;
    let text = String::from_utf8_lossy(&out);
    let mut branches = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("ref: refs/heads/")
            && let Some((branch, "HEAD")) = rest.split_once('\t')
        {
            return Ok(Some(branch.to_owned()));
        }
        if let Some((_, name)) = line.split_once('\t')
            && let Some(branch) = name.strip_prefix("refs/heads/")
        {
            branches.push(branch.to_owned());
        }
    }
    Ok(["main", "master"]
        .into_iter()
        .find(|c| branches.iter().any(|b| b == c))
        .map(str::to_owned)
        .or_else(|| branches.into_iter().next()))
}

/// Makes a bare clone of `remote` at `dest` (which must not exist) and returns the
/// remote's default branch. On any failure nothing is left at `dest`.
pub async fn clone_bare(remote: &Remote<'_>, dest: &Path) -> Result<String, GitError> {
    if tokio::fs::symlink_metadata(dest).await.is_ok() {
        return Err(GitError::Failed(format!(
            "`{}` already exists",
            dest.display()
        )));
    }
    let parent = dest
        .parent()
        .ok_or_else(|| GitError::Failed("a clone needs a parent directory".into()))?;
    tokio::fs::create_dir_all(parent).await?;
    let made = async {
        let mut cmd = command();
        cmd.current_dir(parent)
            .args(["init", "--quiet", "--bare", "--"])
            .arg(dest);
        super::run_ok(cmd, "init").await?;
        let head = remote_head(remote, dest)
            .await?
            .ok_or_else(|| GitError::Failed("the remote has no branch yet".into()))?;
        fetch_into(remote, dest).await?;
        Ok::<_, GitError>(head)
    }
    .await;
    if made.is_err() {
        let _ = tokio::fs::remove_dir_all(dest).await;
    }
    made
}

/// Fetches the remote's branches and tags into the bare clone at `repo`.
pub async fn fetch(remote: &Remote<'_>, repo: &Path) -> Result<(), GitError> {
    let _guard = super::lock_repo(repo).await;
    fetch_into(remote, repo).await
}

async fn fetch_into(remote: &Remote<'_>, repo: &Path) -> Result<(), GitError> {
    let mut cmd = remote.command(repo);
    cmd.args([
        "fetch",
        "--quiet",
        "--prune",
        "--no-write-fetch-head",
        "--no-recurse-submodules",
        "--end-of-options",
    ])
    .arg(remote.url)
    .arg(format!("+refs/heads/*:{REMOTE_BRANCHES}*"))
    .arg("+refs/tags/*:refs/tags/*");
    remote.run_ok(cmd, "fetch").await.map(|_| ())
}

/// Where a pull/merge request's head fetched by [`fetch_ref`] is kept: outside
/// `refs/remotes/origin/`, which every fetch prunes.
pub const FETCHED_REFS: &str = "refs/agentry/fetched/";

/// Fetches the remote's ref `source` (e.g. `refs/pull/12/head`) into the clone at `repo`
/// as `refs/agentry/fetched/<source without refs/>` and returns its commit.
pub async fn fetch_ref(remote: &Remote<'_>, repo: &Path, source: &str) -> Result<String, GitError> {
    let Some(rest) = source.strip_prefix("refs/") else {
        return Err(GitError::UnknownRevision(source.to_owned()));
    };
    if rest.is_empty()
        || rest.contains("..")
        || rest.contains(['*', ':', '^', '~', '?', '[', '\\', '@'])
        || rest.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(GitError::UnknownRevision(source.to_owned()));
    }
    let local = format!("{FETCHED_REFS}{rest}");
    let _guard = super::lock_repo(repo).await;
    let mut cmd = remote.command(repo);
    cmd.args([
        "fetch",
        "--quiet",
        "--no-write-fetch-head",
        "--no-recurse-submodules",
        "--end-of-options",
    ])
    .arg(remote.url)
    .arg(format!("+{source}:{local}"));
    match remote.run_ok(cmd, "fetch").await {
        Ok(_) => {}
        Err(GitError::Failed(m)) if m.contains("couldn't find remote ref") => {
            return Err(GitError::UnknownRevision(source.to_owned()));
        }
        Err(e) => return Err(e),
    }
    super::resolve_commit(repo, &local).await
}

/// How a push ended.
#[derive(Debug, PartialEq, Eq)]
pub enum PushOutcome {
    /// The remote's branch now points at the commit pushed.
    Pushed,
    /// The remote refused: its branch has commits the pushed one lacks (without force),
    /// or a rule of the remote refused it; git's reason.
    Rejected(String),
}

/// Pushes local branch `branch` of the clone at `repo` to `refs/heads/<target>` of the
/// remote; `force` allows a push that is not a fast-forward. Runs no hook.
pub async fn push(
    remote: &Remote<'_>,
    repo: &Path,
    branch: &str,
    target: &str,
    force: bool,
) -> Result<PushOutcome, GitError> {
    let mut cmd = remote.command(repo);
    cmd.args([
        "push",
        "--porcelain",
        "--no-verify",
        "--no-recurse-submodules",
        "--end-of-options",
    ])
    .arg(remote.url)
    .arg(format!(
        "{}refs/heads/{branch}:refs/heads/{target}",
        if force { "+" } else { "" }
    ));
    let out = match tokio::time::timeout(remote.timeout, run(cmd)).await {
        Ok(out) => out?,
        Err(_) => {
            return Err(GitError::Failed(format!(
                "git push: no answer within {} s",
                remote.timeout.as_secs()
            )));
        }
    };
    // `--porcelain` prints one line per ref: `<flag>\t<from>:<to>\t<summary>`; `!` is
    // a refusal.
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in stdout.lines() {
        let mut parts = line.split('\t');
        if parts.next() == Some("!") {
            let _ = parts.next();
            let why = parts.next().unwrap_or("rejected").trim().to_owned();
            return Ok(PushOutcome::Rejected(remote.scrub(&why)));
        }
    }
    if out.status.success() {
        return Ok(PushOutcome::Pushed);
    }
    let stderr = remote.scrub(String::from_utf8_lossy(&out.stderr).trim());
    tracing::debug!(status = %out.status, stderr, "git push failed");
    Err(GitError::Failed(format!("git push: {stderr}")))
}

/// Resolves `rev` in a clone: the remote's branch of that name first, else whatever
/// `rev` names (a tag, a commit).
pub async fn resolve_in_clone(repo: &Path, rev: &str) -> Result<String, GitError> {
    let unknown = || GitError::UnknownRevision(rev.to_owned());
    if rev.is_empty() || rev.starts_with('-') || rev.chars().any(char::is_control) {
        return Err(unknown());
    }
    let mut cmd = at(repo);
    cmd.args(["rev-parse", "--verify", "--quiet", "--end-of-options"])
        .arg(format!("{REMOTE_BRANCHES}{rev}^{{commit}}"));
    let out = run(cmd).await?;
    if out.status.success() {
        return Ok(stdout_line(&out.stdout));
    }
    super::resolve_commit(repo, rev).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(secret: &SecretValue) -> Remote<'_> {
        Remote {
            url: "https://example.com/r.git",
            pinned: None,
            credential: Some(secret),
            timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn basic_for_user_and_password_bearer_otherwise() {
        let basic = SecretValue::new("git:s3cret-pass");
        assert_eq!(
            remote(&basic).authorization().unwrap(),
            "Authorization: Basic Z2l0OnMzY3JldC1wYXNz"
        );
        let bearer = SecretValue::new("tok-123456");
        assert_eq!(
            remote(&bearer).authorization().unwrap(),
            "Authorization: Bearer tok-123456"
        );
    }

    #[test]
    fn scrub_removes_the_value_and_its_encoding() {
        let basic = SecretValue::new("git:s3cret-pass");
        let r = remote(&basic);
        let text = r.scrub("fatal: Z2l0OnMzY3JldC1wYXNz and s3cret-pass and git:s3cret-pass");
        assert!(!text.contains("s3cret"), "{text}");
        assert!(!text.contains("Z2l0OnMzY3JldC1wYXNz"), "{text}");
    }
}
