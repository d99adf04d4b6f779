//! What a forge's webhook delivery asks for, by the trigger's rules: open an agent on an
//! issue that got the label, send a comment that mentions the handle to the agent of the
//! pull/merge request, tell that agent which check failed and why, or nothing (with the
//! reason). Pure functions of the event name and the JSON body; nothing here is run.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{IssueRule, MentionRule, Rules};
use crate::forge::ForgeKind;

/// Which pull/merge request a delivery is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    Number(i64),
    /// GitLab job hooks name the branch, not the merge request.
    Branch(String),
}

/// A failed job whose log the forge can be asked for (GitLab).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub id: i64,
    pub name: String,
}

/// Kept with a pending run (`trigger_runs.work`) until a worker acts on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// Open a workspace on the project's default branch and an agent with this prompt.
    OpenAgent {
        title: String,
        prompt: String,
    },
    /// Send a comment's text to the agent of the pull/merge request.
    Comment {
        target: Target,
        text: String,
    },
    /// Tell the agent of the pull/merge request which check failed, with an excerpt of
    /// its output when the delivery carries one, or jobs whose logs may be fetched.
    FailedCheck {
        target: Target,
        name: String,
        excerpt: Option<String>,
        jobs: Vec<Job>,
        /// GitHub: the workflow run whose failed jobs' logs may be fetched.
        #[serde(default)]
        workflow_run: Option<i64>,
    },
    Ignore(String),
}

fn ignore(why: impl Into<String>) -> Decision {
    Decision::Ignore(why.into())
}

/// Fills `{{title}}`, `{{body}}`, `{{number}}` and `{{url}}` in one pass: a value that
/// itself holds `{{…}}` stays as it is.
pub fn fill(template: &str, title: &str, body: &str, number: i64, url: &str) -> String {
    let mut out = String::with_capacity(template.len() + body.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            out.push_str(&rest[start..]);
            return out;
        };
        match after[..end].trim() {
            "title" => out.push_str(title),
            "body" => out.push_str(body),
            "number" => out.push_str(&number.to_string()),
            "url" => out.push_str(url),
            _ => out.push_str(&rest[start..start + 2 + end + 2]),
        }
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Whether `text` mentions `handle` (case-insensitive, not inside a longer name).
pub fn mentions(text: &str, handle: &str) -> bool {
    let (text, handle) = (text.to_lowercase(), handle.to_lowercase());
    let mut from = 0;
    while let Some(i) = text[from..].find(&handle) {
        let end = from + i + handle.len();
        let next = text[end..].chars().next();
        let before = text[..from + i].chars().next_back();
        let word = |c: char| c.is_alphanumeric() || c == '-' || c == '_';
        if !next.is_some_and(word) && !before.is_some_and(|c| word(c) || c == '@') {
            return true;
        }
        from = end;
    }
    false
}

/// The last `max` bytes of `text` (the end of a log says most), on a character boundary.
pub fn tail(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

/// Whether a log line reports an error (a compiler's `error:` or `error[…]`, a runner's
/// `##[error]`, a panic, a failed test or step, a traceback).
fn reports_error(line: &str) -> bool {
    let line = line.to_lowercase();
    [
        "error:",
        "error[",
        "##[error]",
        "panicked",
        "failed",
        "failure",
        "traceback",
    ]
    .iter()
    .any(|m| line.contains(m))
}

/// At most `max` bytes of a job's log around its first error: from two lines before the
/// first line that reports one, onwards (its start kept, the rest cut); the end of the
/// log when no line does.
pub fn around_first_error(log: &str, max: usize) -> String {
    let lines: Vec<(usize, &str)> = log
        .split_inclusive('\n')
        .scan(0, |at, line| {
            let start = *at;
            *at += line.len();
            Some((start, line))
        })
        .collect();
    let Some(first) = lines.iter().position(|(_, l)| reports_error(l)) else {
        return tail(log, max);
    };
    let from = lines[first.saturating_sub(2)].0;
    let window = &log[from..];
    if window.len() <= max {
        return window.to_owned();
    }
    let mut end = max;
    while !window.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &window[..end])
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// What a delivery says of pull/merge requests' state (`open`, `merged`, `closed`) or
/// checks (`pending`, `passing`, `failing`), whatever the rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrNews {
    pub numbers: Vec<i64>,
    pub state: Option<&'static str>,
    pub checks: Option<&'static str>,
}

fn numbers_at(v: &Value, pointer: &str) -> Vec<i64> {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|p| p["number"].as_i64()).collect())
        .unwrap_or_default()
}

/// A completed check's conclusion as the checks of its pull request: a failure fails
/// them; a success says nothing of the others unless it is the whole suite.
fn concluded(conclusion: &str, whole: bool) -> Option<&'static str> {
    match conclusion {
        "failure" | "timed_out" | "cancelled" | "action_required" | "startup_failure" => {
            Some("failing")
        }
        "success" | "neutral" | "skipped" if whole => Some("passing"),
        _ => None,
    }
}

/// The pull/merge request news in a delivery, if any.
pub fn pr_news(kind: ForgeKind, event: &str, body: &Value) -> Option<PrNews> {
    let action = str_at(body, "/action");
    let news = match kind {
        ForgeKind::GitHub => match event {
            "pull_request" => {
                let number = body["pull_request"]["number"]
                    .as_i64()
                    .or(body["number"].as_i64())?;
                let (state, checks) = match action {
                    "closed" if body["pull_request"]["merged"].as_bool() == Some(true) => {
                        (Some("merged"), None)
                    }
                    "closed" => (Some("closed"), None),
                    "reopened" => (Some("open"), None),
                    // New commits: their checks start again.
                    "synchronize" => (Some("open"), Some("pending")),
                    _ => return None,
                };
                PrNews {
                    numbers: vec![number],
                    state,
                    checks,
                }
            }
            "check_suite" | "check_run" | "workflow_run" if action == "completed" => {
                let at = match event {
                    "check_suite" => "/check_suite",
                    "check_run" => "/check_run",
                    _ => "/workflow_run",
                };
                let conclusion = body
                    .pointer(&format!("{at}/conclusion"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                PrNews {
                    numbers: numbers_at(body, &format!("{at}/pull_requests")),
                    state: None,
                    checks: Some(concluded(conclusion, event == "check_suite")?),
                }
            }
            _ => return None,
        },
        ForgeKind::GitLab => {
            let attrs = &body["object_attributes"];
            match str_at(body, "/object_kind") {
                "merge_request" => PrNews {
                    numbers: attrs["iid"].as_i64().into_iter().collect(),
                    state: Some(match str_at(attrs, "/action") {
                        "close" => "closed",
                        "merge" => "merged",
                        "reopen" => "open",
                        _ => return None,
                    }),
                    checks: None,
                },
                "pipeline" => PrNews {
                    numbers: body
                        .pointer("/merge_request/iid")
                        .and_then(Value::as_i64)
                        .into_iter()
                        .collect(),
                    state: None,
                    checks: Some(match str_at(attrs, "/status") {
                        "success" => "passing",
                        "failed" => "failing",
                        "created"
                        | "waiting_for_resource"
                        | "preparing"
                        | "pending"
                        | "running" => "pending",
                        _ => return None,
                    }),
                },
                _ => return None,
            }
        }
    };
    (!news.numbers.is_empty()).then_some(news)
}

pub fn decide(kind: ForgeKind, event: &str, body: &Value, rules: &Rules) -> Decision {
    match kind {
        ForgeKind::GitHub => github(event, body, rules),
        ForgeKind::GitLab => gitlab(event, body, rules),
    }
}

fn issue_prompt(rule: &IssueRule, title: &str, body: &str, number: i64, url: &str) -> Decision {
    Decision::OpenAgent {
        title: format!("#{number} {title}").chars().take(200).collect(),
        prompt: fill(&rule.prompt, title, body, number, url),
    }
}

fn github(event: &str, body: &Value, rules: &Rules) -> Decision {
    let action = str_at(body, "/action");
    match event {
        "ping" => ignore("a ping: the webhook reaches this trigger"),
        "issues" => {
            let Some(rule) = &rules.issue_labeled else {
                return ignore("the issue_labeled rule is off");
            };
            if action != "labeled" {
                return ignore(format!("issues action `{action}` is not `labeled`"));
            }
            let label = str_at(body, "/label/name");
            if label != rule.label {
                return ignore(format!("label `{label}` is not `{}`", rule.label));
            }
            let issue = &body["issue"];
            issue_prompt(
                rule,
                str_at(issue, "/title"),
                str_at(issue, "/body"),
                issue["number"].as_i64().unwrap_or_default(),
                str_at(issue, "/html_url"),
            )
        }
        "issue_comment" | "pull_request_review_comment" => {
            let Some(rule) = &rules.mention else {
                return ignore("the mention rule is off");
            };
            if action != "created" {
                return ignore(format!("comment action `{action}` is not `created`"));
            }
            let number = if event == "issue_comment" {
                if body.pointer("/issue/pull_request").is_none() {
                    return ignore("a comment on an issue, not on a pull request");
                }
                body.pointer("/issue/number").and_then(Value::as_i64)
            } else {
                body.pointer("/pull_request/number").and_then(Value::as_i64)
            };
            comment(rule, number, str_at(body, "/comment/body"))
        }
        "check_run" => {
            let Some(rule) = &rules.failed_check else {
                return ignore("the failed_check rule is off");
            };
            let run = &body["check_run"];
            if action != "completed" || str_at(run, "/conclusion") != "failure" {
                return ignore(format!(
                    "check run `{}` is not a completed failure",
                    str_at(run, "/name")
                ));
            }
            let Some(number) = run
                .pointer("/pull_requests/0/number")
                .and_then(Value::as_i64)
            else {
                return ignore("the check run belongs to no pull request");
            };
            let output = ["/output/title", "/output/summary", "/output/text"]
                .iter()
                .map(|p| str_at(run, p))
                .filter(|t| !t.is_empty())
                .collect::<Vec<_>>()
                .join("\n\n");
            Decision::FailedCheck {
                target: Target::Number(number),
                name: str_at(run, "/name").to_owned(),
                excerpt: (!output.is_empty()).then(|| tail(&output, rule.max_excerpt_bytes)),
                jobs: Vec::new(),
                workflow_run: None,
            }
        }
        "workflow_run" => {
            if rules.failed_check.is_none() {
                return ignore("the failed_check rule is off");
            }
            let run = &body["workflow_run"];
            if action != "completed" || str_at(run, "/conclusion") != "failure" {
                return ignore(format!(
                    "workflow run `{}` is not a completed failure",
                    str_at(run, "/name")
                ));
            }
            let Some(number) = run
                .pointer("/pull_requests/0/number")
                .and_then(Value::as_i64)
            else {
                return ignore("the workflow run belongs to no pull request");
            };
            Decision::FailedCheck {
                target: Target::Number(number),
                name: str_at(run, "/name").to_owned(),
                excerpt: None,
                jobs: Vec::new(),
                workflow_run: run["id"].as_i64(),
            }
        }
        other => ignore(format!("event `{other}` starts nothing")),
    }
}

fn comment(rule: &MentionRule, number: Option<i64>, text: &str) -> Decision {
    let Some(number) = number else {
        return ignore("the comment names no pull request");
    };
    if !mentions(text, &rule.handle) {
        return ignore(format!("the comment does not mention {}", rule.handle));
    }
    Decision::Comment {
        target: Target::Number(number),
        text: text.to_owned(),
    }
}

fn gitlab(event: &str, body: &Value, rules: &Rules) -> Decision {
    let kind = str_at(body, "/object_kind");
    let attrs = &body["object_attributes"];
    match (event, kind) {
        ("Issue Hook" | "Confidential Issue Hook", _) | ("", "issue") => {
            let Some(rule) = &rules.issue_labeled else {
                return ignore("the issue_labeled rule is off");
            };
            let titles = |p: &str| -> Vec<String> {
                body.pointer(p)
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|l| l["title"].as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let (before, after) = (
                titles("/changes/labels/previous"),
                titles("/changes/labels/current"),
            );
            if !after.contains(&rule.label) || before.contains(&rule.label) {
                return ignore(format!("label `{}` was not added", rule.label));
            }
            issue_prompt(
                rule,
                str_at(attrs, "/title"),
                str_at(attrs, "/description"),
                attrs["iid"].as_i64().unwrap_or_default(),
                str_at(attrs, "/url"),
            )
        }
        ("Note Hook" | "Confidential Note Hook", _) | ("", "note") => {
            let Some(rule) = &rules.mention else {
                return ignore("the mention rule is off");
            };
            if str_at(attrs, "/noteable_type") != "MergeRequest" {
                return ignore("a comment on something other than a merge request");
            }
            comment(
                rule,
                body.pointer("/merge_request/iid").and_then(Value::as_i64),
                str_at(attrs, "/note"),
            )
        }
        ("Pipeline Hook", _) | ("", "pipeline") => {
            if rules.failed_check.is_none() {
                return ignore("the failed_check rule is off");
            }
            if str_at(attrs, "/status") != "failed" {
                return ignore(format!(
                    "pipeline status `{}` is not `failed`",
                    str_at(attrs, "/status")
                ));
            }
            let Some(iid) = body.pointer("/merge_request/iid").and_then(Value::as_i64) else {
                return ignore("the pipeline belongs to no merge request");
            };
            let jobs: Vec<Job> = body["builds"]
                .as_array()
                .map(|b| {
                    b.iter()
                        .filter(|j| j["status"] == "failed")
                        .filter_map(|j| {
                            Some(Job {
                                id: j["id"].as_i64()?,
                                name: j["name"].as_str().unwrap_or("").to_owned(),
                            })
                        })
                        .collect()
                })
                .unwrap_or_default();
            let name = if jobs.is_empty() {
                format!("pipeline {}", attrs["id"].as_i64().unwrap_or_default())
            } else {
                jobs.iter()
                    .map(|j| j.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            Decision::FailedCheck {
                target: Target::Number(iid),
                name,
                excerpt: None,
                jobs,
                workflow_run: None,
            }
        }
        ("Job Hook", _) | ("", "build") => {
            if rules.failed_check.is_none() {
                return ignore("the failed_check rule is off");
            }
            if str_at(body, "/build_status") != "failed" {
                return ignore(format!(
                    "job status `{}` is not `failed`",
                    str_at(body, "/build_status")
                ));
            }
            let branch = str_at(body, "/ref");
            if branch.is_empty() {
                return ignore("the job names no branch");
            }
            let reason = str_at(body, "/build_failure_reason");
            Decision::FailedCheck {
                target: Target::Branch(branch.to_owned()),
                name: str_at(body, "/build_name").to_owned(),
                excerpt: (!reason.is_empty()).then(|| format!("failure reason: {reason}")),
                jobs: body["build_id"]
                    .as_i64()
                    .map(|id| Job {
                        id,
                        name: str_at(body, "/build_name").to_owned(),
                    })
                    .into_iter()
                    .collect(),
                workflow_run: None,
            }
        }
        (other, _) => ignore(format!("event `{other}` starts nothing")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_are_filled_once_and_never_evaluated() {
        assert_eq!(
            fill(
                "Fix #{{number}}: {{title}}\n{{ body }}\n{{url}} {{other}} {{",
                "Crash",
                "it says {{title}}",
                7,
                "https://x/7"
            ),
            "Fix #7: Crash\nit says {{title}}\nhttps://x/7 {{other}} {{"
        );
    }

    #[test]
    fn mentions_are_whole_handles() {
        assert!(mentions("@agentry fix this", "@agentry"));
        assert!(mentions("please, @Agentry.", "@agentry"));
        assert!(!mentions("@agentry-bot fix this", "@agentry"));
        assert!(!mentions("mail x@agentry", "@agentry"));
        assert!(!mentions("agentry fix this", "@agentry"));
    }

    #[test]
    fn excerpts_start_just_before_the_first_error() {
        let log = format!(
            "{}compile a\ncompile b\nerror[E0308]: mismatched types\n  --> src/a.rs:3\n{}##[error]Process completed with exit code 1.\n",
            "setup\n".repeat(500),
            "note\n".repeat(10)
        );
        let e = around_first_error(&log, 4096);
        assert!(e.starts_with("compile a\ncompile b\nerror[E0308]"), "{e}");
        assert!(e.ends_with("exit code 1.\n"), "{e}");
        let short = around_first_error(&log, 40);
        assert!(short.starts_with("compile a"), "{short}");
        assert!(short.len() <= 40 + '…'.len_utf8(), "{short}");
        // No error line: the end.
        assert_eq!(around_first_error("a\nb\nall good\n", 5), "…good\n");
    }

    #[test]
    fn workflow_runs_name_the_run_whose_jobs_failed() {
        let rules = Rules::default();
        let body = serde_json::json!({"action": "completed", "workflow_run": {"id": 99,
            "name": "tests", "conclusion": "failure", "pull_requests": [{"number": 7}]}});
        match decide(ForgeKind::GitHub, "workflow_run", &body, &rules) {
            Decision::FailedCheck {
                target,
                name,
                workflow_run,
                ..
            } => {
                assert_eq!(target, Target::Number(7));
                assert_eq!(name, "tests");
                assert_eq!(workflow_run, Some(99));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn pull_request_news_is_read_from_either_forge() {
        use serde_json::json;
        let gh = |event: &str, body: Value| pr_news(ForgeKind::GitHub, event, &body);
        assert_eq!(
            gh(
                "pull_request",
                json!({"action": "closed", "pull_request": {"number": 7, "merged": true}})
            ),
            Some(PrNews {
                numbers: vec![7],
                state: Some("merged"),
                checks: None
            })
        );
        assert_eq!(
            gh(
                "pull_request",
                json!({"action": "closed", "pull_request": {"number": 7, "merged": false}})
            )
            .and_then(|n| n.state),
            Some("closed")
        );
        assert_eq!(
            gh(
                "pull_request",
                json!({"action": "labeled", "pull_request": {"number": 7}})
            ),
            None
        );
        assert_eq!(
            gh(
                "check_suite",
                json!({"action": "completed", "check_suite": {"conclusion": "success",
                "pull_requests": [{"number": 7}, {"number": 8}]}})
            ),
            Some(PrNews {
                numbers: vec![7, 8],
                state: None,
                checks: Some("passing")
            })
        );
        // One check run passing says nothing of the others; one failing fails them.
        let run = |c: &str| {
            json!({"action": "completed", "check_run": {"conclusion": c,
            "pull_requests": [{"number": 7}]}})
        };
        assert_eq!(gh("check_run", run("success")), None);
        assert_eq!(
            gh("check_run", run("failure")).and_then(|n| n.checks),
            Some("failing")
        );
        let gl = |body: Value| pr_news(ForgeKind::GitLab, "", &body);
        assert_eq!(
            gl(json!({"object_kind": "merge_request", "object_attributes": {"iid": 3, "action": "merge"}}))
                .and_then(|n| n.state),
            Some("merged")
        );
        assert_eq!(
            gl(
                json!({"object_kind": "pipeline", "object_attributes": {"status": "running"},
                "merge_request": {"iid": 3}})
            ),
            Some(PrNews {
                numbers: vec![3],
                state: None,
                checks: Some("pending")
            })
        );
        assert_eq!(
            gl(json!({"object_kind": "pipeline", "object_attributes": {"status": "failed"}})),
            None,
            "a pipeline of no merge request"
        );
    }

    #[test]
    fn tails_keep_the_end_on_a_character_boundary() {
        assert_eq!(tail("abc", 5), "abc");
        assert_eq!(tail("abcdef", 3), "…def");
        assert_eq!(tail("aé", 1), "…");
    }
}
