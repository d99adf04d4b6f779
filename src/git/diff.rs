//! Working-tree diffs against a base commit, untracked files included.
//!
//! The working tree is staged with `git add -A` into the index of a view (see
//! `view.rs`: a private git dir with a config of the server's making, so no filter or
//! other driver the tree or the repository names can run), which starts as a copy of
//! the worktree's own index so unchanged files are not hashed again; that index is
//! diffed against the base commit. The worktree's real index is never touched.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Output, Stdio};

use tokio::io::AsyncReadExt;
use tokio::process::Command;

use super::view::View;
use super::{Diff, DiffFile, GitError, failure, run, run_ok};

/// Largest patch returned by [`super::diff`], in bytes, before the truncation note.
pub const PATCH_LIMIT: usize = 8 * 1024 * 1024;

/// Appended to a patch cut at [`PATCH_LIMIT`].
const TRUNCATION_NOTE: &str = "\n[patch truncated at 8 MiB]\n";

/// How much of git's stderr is kept for error messages.
const STDERR_LIMIT: u64 = 64 * 1024;

/// The diff of `work_tree` against `base` (a full commit id), through a view of the
/// repository whose common dir is `common`, starting from a copy of `index`.
pub(super) async fn diff(
    common: &Path,
    index: &Path,
    work_tree: &Path,
    base: String,
) -> Result<Diff, GitError> {
    let view = View::create(common, Some(index)).await?;
    let add = || {
        let mut cmd = view.git(work_tree, None);
        cmd.args([
            "-c",
            "core.safecrlf=false",
            "-c",
            "advice.addEmbeddedRepo=false",
            "add",
            "--all",
            "--ignore-errors",
        ]);
        cmd
    };
    let mut out = run(add()).await?;
    if out.status.code() == Some(128) {
        // The copied index may be one git cannot use here (a split index whose shared
        // part stayed behind, a newer format): start again from an empty one.
        tracing::debug!(
            work_tree = %work_tree.display(),
            stderr = %String::from_utf8_lossy(&out.stderr).trim(),
            "staging from the copied index failed; staging from an empty one"
        );
        view.forget_index();
        out = run(add()).await?;
    }
    match out.status.code() {
        Some(0) => {}
        // Some paths could not be added (unreadable file, nested repository without
        // a commit, ...): the rest is staged, so show what we can.
        Some(1) => tracing::warn!(
            work_tree = %work_tree.display(),
            stderr = %String::from_utf8_lossy(&out.stderr).trim(),
            "some files were left out of the diff"
        ),
        _ => return Err(failure("add", &out)),
    }

    let diff_cmd = |format: &[&str]| {
        let mut cmd = view.git(work_tree, None);
        cmd.args([
            "diff",
            "--cached",
            "--no-color",
            "--no-ext-diff",
            "--no-textconv",
            "--no-relative",
            "-M",
        ])
        .args(format)
        .arg(&base)
        .arg("--");
        cmd
    };
    let (numstat, name_status, (patch, truncated)) = tokio::try_join!(
        run_ok(diff_cmd(&["--numstat", "-z"]), "diff --numstat"),
        run_ok(diff_cmd(&["--name-status", "-z"]), "diff --name-status"),
        run_capped(
            diff_cmd(&["-p", "--src-prefix=a/", "--dst-prefix=b/"]),
            PATCH_LIMIT,
            "diff -p",
        ),
    )?;
    drop(view);

    Ok(Diff {
        base_commit: base,
        files: merge(&parse_name_status(&name_status), &parse_numstat(&numstat)),
        patch: finish_patch(patch, truncated),
    })
}

/// Runs a command keeping at most `limit` bytes of stdout; returns the output and
/// whether there was more (then git is stopped early and its exit status ignored).
async fn run_capped(
    mut cmd: Command,
    limit: usize,
    what: &str,
) -> Result<(Vec<u8>, bool), GitError> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    let (Some(stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(GitError::Failed(format!("git {what}: output not captured")));
    };

    let read_stdout = async move {
        let mut buf = Vec::new();
        let mut stdout = stdout.take(limit as u64 + 1);
        stdout.read_to_end(&mut buf).await?;
        // Dropping the pipe here makes git stop (SIGPIPE) if it had more to say.
        drop(stdout);
        Ok::<_, std::io::Error>(buf)
    };
    let read_stderr = async {
        let mut buf = Vec::new();
        (&mut stderr)
            .take(STDERR_LIMIT)
            .read_to_end(&mut buf)
            .await?;
        tokio::io::copy(&mut stderr, &mut tokio::io::sink()).await?;
        Ok::<_, std::io::Error>(buf)
    };
    let (stdout, stderr) = tokio::join!(read_stdout, read_stderr);
    let (mut stdout, stderr) = (stdout?, stderr?);

    let truncated = stdout.len() > limit;
    if truncated {
        let _ = child.start_kill();
    }
    let status = child.wait().await?;
    if truncated {
        stdout.truncate(limit);
    } else if !status.success() {
        return Err(failure(
            what,
            &Output {
                status,
                stdout: Vec::new(),
                stderr,
            },
        ));
    }
    Ok((stdout, truncated))
}

/// The patch as text; a truncated one is cut after its last complete line and
/// followed by [`TRUNCATION_NOTE`].
fn finish_patch(mut patch: Vec<u8>, truncated: bool) -> String {
    if !truncated {
        return String::from_utf8_lossy(&patch).into_owned();
    }
    if let Some(end) = patch.iter().rposition(|&b| b == b'\n') {
        patch.truncate(end + 1);
    }
    let mut text = String::from_utf8_lossy(&patch).into_owned();
    text.push_str(TRUNCATION_NOTE);
    text
}

fn path_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `git diff --name-status -z`: `STATUS\0PATH\0`, or `R100\0OLD\0NEW\0` for renames
/// and copies. Returns (path, status) with the new path for renames and copies.
fn parse_name_status(out: &[u8]) -> Vec<(String, &'static str)> {
    let mut fields = out.split(|&b| b == 0);
    let mut entries = Vec::new();
    while let Some(status) = fields.next() {
        let Some(&letter) = status.first() else {
            continue;
        };
        let Some(mut path) = fields.next() else {
            break;
        };
        if matches!(letter, b'R' | b'C') {
            let Some(new_path) = fields.next() else {
                break;
            };
            path = new_path;
        }
        let status = match letter {
            b'A' | b'C' => "added",
            b'D' => "deleted",
            b'R' => "renamed",
            _ => "modified",
        };
        entries.push((path_text(path), status));
    }
    entries
}

/// `git diff --numstat -z`: `ADDS\tDELS\tPATH\0`, or `ADDS\tDELS\t\0OLD\0NEW\0` for
/// renames and copies; binary files count `-` (taken as 0).
fn parse_numstat(out: &[u8]) -> BTreeMap<String, (u64, u64)> {
    let count = |field: Option<&[u8]>| {
        field
            .and_then(|f| std::str::from_utf8(f).ok())
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let mut fields = out.split(|&b| b == 0);
    let mut counts = BTreeMap::new();
    while let Some(record) = fields.next() {
        if record.is_empty() {
            continue;
        }
        let mut parts = record.splitn(3, |&b| b == b'\t');
        let additions = count(parts.next());
        let deletions = count(parts.next());
        let mut path = parts.next().unwrap_or_default();
        if path.is_empty() {
            let _old_path = fields.next();
            path = fields.next().unwrap_or_default();
        }
        counts.insert(path_text(path), (additions, deletions));
    }
    counts
}

/// One [`DiffFile`] per changed path, sorted by path.
fn merge(
    statuses: &[(String, &'static str)],
    counts: &BTreeMap<String, (u64, u64)>,
) -> Vec<DiffFile> {
    let mut files: BTreeMap<&str, DiffFile> = BTreeMap::new();
    for (path, status) in statuses {
        let (additions, deletions) = counts.get(path).copied().unwrap_or((0, 0));
        files.insert(
            path,
            DiffFile {
                path: path.clone(),
                status: (*status).to_owned(),
                additions,
                deletions,
            },
        );
    }
    files.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_name_status_with_renames() {
        let out = b"M\0src/a.rs\0R087\0old name\0new name\0A\0b\0D\0c\0T\0d\0C100\0e\0f\0";
        assert_eq!(
            parse_name_status(out),
            vec![
                ("src/a.rs".to_owned(), "modified"),
                ("new name".to_owned(), "renamed"),
                ("b".to_owned(), "added"),
                ("c".to_owned(), "deleted"),
                ("d".to_owned(), "modified"),
                ("f".to_owned(), "added"),
            ]
        );
    }

    #[test]
    fn parses_numstat_with_renames_and_binaries() {
        let out = b"3\t1\tsrc/a.rs\0-\t-\timg.png\x002\t0\t\0old\0new\0";
        let counts = parse_numstat(out);
        assert_eq!(counts["src/a.rs"], (3, 1));
        assert_eq!(counts["img.png"], (0, 0));
        assert_eq!(counts["new"], (2, 0));
        assert_eq!(counts.len(), 3);
    }

    #[test]
    fn tab_in_path_survives() {
        let counts = parse_numstat(b"1\t2\ta\tb\0");
        assert_eq!(counts["a\tb"], (1, 2));
    }

    #[test]
    fn truncated_patch_ends_at_a_line() {
        let patch = finish_patch(b"line one\nline tw".to_vec(), true);
        assert_eq!(patch, format!("line one\n{TRUNCATION_NOTE}"));
        assert_eq!(finish_patch(b"whole\n".to_vec(), false), "whole\n");
    }

    #[test]
    fn merge_sorts_by_path() {
        let statuses = vec![("b".to_owned(), "added"), ("a".to_owned(), "modified")];
        let counts = BTreeMap::from([("a".to_owned(), (1, 1)), ("b".to_owned(), (4, 0))]);
        let files = merge(&statuses, &counts);
        let paths: Vec<_> = files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["a", "b"]);
        assert_eq!((files[1].additions, files[1].deletions), (4, 0));
    }
}
