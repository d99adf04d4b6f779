//! How events look in a terminal: the conversation on stdout (assistant text as it
//! streams, tool calls, permission requests, the end of each turn), agent status changes
//! on stderr (as plain lines, or as the spinner's status when stderr is a terminal, see
//! [`Progress`]); colour only on a terminal and never with `NO_COLOR`. With `--json`,
//! each event is the API's own object on one line.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};

use serde_json::Value;

use super::progress::Progress;

/// Whether to colour and whether stdout is a terminal.
#[derive(Debug, Clone, Copy)]
pub struct Style {
    pub color: bool,
}

impl Style {
    pub fn detect() -> Self {
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        Self {
            color: std::io::stdout().is_terminal() && !no_color,
        }
    }

    fn paint(&self, code: &str, text: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }

    pub fn bold(&self, t: &str) -> String {
        self.paint("1", t)
    }
    pub fn dim(&self, t: &str) -> String {
        self.paint("2", t)
    }
    pub fn red(&self, t: &str) -> String {
        self.paint("31", t)
    }
    pub fn green(&self, t: &str) -> String {
        self.paint("32", t)
    }
    pub fn yellow(&self, t: &str) -> String {
        self.paint("33", t)
    }
}

/// Prints a stream of events.
pub struct Renderer {
    style: Style,
    json: bool,
    /// The message whose deltas are being printed (its line is open).
    open_message: Option<String>,
    /// Messages whose text already went out as deltas.
    streamed: std::collections::HashSet<String>,
    /// The last status printed for each tool call.
    tools: HashMap<String, String>,
    progress: Progress,
    /// What the agent is doing, for the spinner.
    activity: String,
    /// Tokens used so far (input + output), for the spinner.
    tokens: i64,
}

impl Renderer {
    pub fn new(style: Style, json: bool, progress: Progress) -> Self {
        Self {
            style,
            json,
            open_message: None,
            streamed: Default::default(),
            tools: HashMap::new(),
            progress,
            activity: String::new(),
            tokens: 0,
        }
    }

    /// Show the spinner saying `activity` (when there is one).
    pub fn waiting(&mut self, activity: &str) {
        self.activity = activity.to_owned();
        self.update_spinner();
        if self.open_message.is_none() {
            self.progress.show();
        }
    }

    fn update_spinner(&mut self) {
        let message = if self.tokens > 0 {
            format!("{} · {} tokens", self.activity, self.tokens)
        } else {
            self.activity.clone()
        };
        self.progress.set_message(message);
    }

    /// A line for the person watching, on stderr, past the spinner.
    pub fn note(&self, line: &str) {
        self.progress.print(|| eprintln!("{line}"));
    }

    fn close_line(&mut self, out: &mut impl Write) {
        if self.open_message.take().is_some() {
            let _ = writeln!(out);
        }
    }

    /// Print one event: rendered into a buffer, then written with the spinner out of
    /// the way (and kept away while a streamed message's line is open).
    pub fn event(&mut self, e: &Value) {
        let mut out = Vec::new();
        self.render(e, &mut out);
        self.track(e);
        if out.is_empty() {
            return;
        }
        let write = || {
            let stdout = std::io::stdout();
            let mut lock = stdout.lock();
            let _ = lock.write_all(&out);
            let _ = lock.flush();
        };
        if self.open_message.is_some() {
            self.progress.hide();
            write();
        } else {
            self.progress.print(write);
            if !self.activity.is_empty() {
                self.progress.show();
            }
        }
    }

    /// Follow what the agent is doing, for the spinner.
    fn track(&mut self, e: &Value) {
        if !self.progress.is_drawn() {
            return;
        }
        let d = &e["data"];
        let activity = match e["kind"].as_str().unwrap_or("") {
            "turn_started" | "permission_resolved" | "user_message" => "working".to_owned(),
            "assistant_delta" | "assistant_message" => "replying".to_owned(),
            "reasoning_delta" | "reasoning" => "thinking".to_owned(),
            "tool_call" => match d["status"].as_str() {
                Some("pending" | "running") => {
                    let title = d["title"].as_str().filter(|t| !t.is_empty());
                    format!(
                        "running {}",
                        title.or(d["name"].as_str()).unwrap_or("a tool")
                    )
                }
                _ => "working".to_owned(),
            },
            "permission_requested" => format!(
                "waiting for an answer to \"{}\" (agentry approve/deny {})",
                d["title"].as_str().unwrap_or(""),
                e["agent_id"].as_str().unwrap_or("")
            ),
            "usage" => {
                self.tokens = d["input_tokens"].as_i64().unwrap_or(0)
                    + d["output_tokens"].as_i64().unwrap_or(0);
                self.update_spinner();
                return;
            }
            "status" => d["status"].as_str().unwrap_or("").replace('_', " "),
            "turn_completed" => "waiting for events".to_owned(),
            _ => return,
        };
        self.activity = activity;
        self.update_spinner();
    }

    fn render(&mut self, e: &Value, out: &mut Vec<u8>) {
        if self.json {
            let _ = writeln!(out, "{e}");
            return;
        }
        let s = self.style;
        let d = &e["data"];
        let text = |k: &str| d[k].as_str().unwrap_or("").to_owned();
        match e["kind"].as_str().unwrap_or("") {
            "user_message" => {
                self.close_line(out);
                let _ = writeln!(out, "{} {}", s.bold(">"), s.bold(&text("text")));
            }
            "assistant_delta" => {
                let id = text("message_id");
                if self.open_message.as_deref() != Some(id.as_str()) {
                    self.close_line(out);
                    self.open_message = Some(id.clone());
                }
                self.streamed.insert(id);
                let _ = write!(out, "{}", text("text"));
            }
            "assistant_message" => {
                let id = text("message_id");
                if self.streamed.remove(&id) {
                    self.close_line(out);
                } else {
                    self.close_line(out);
                    let _ = writeln!(out, "{}", text("text"));
                }
            }
            "reasoning" => {
                self.close_line(out);
                let _ = writeln!(out, "{}", s.dim(&format!("(thinking) {}", text("text"))));
            }
            "tool_call" => {
                let id = text("call_id");
                let status = text("status");
                if self.tools.get(&id) == Some(&status) {
                    return;
                }
                self.tools.insert(id, status.clone());
                self.close_line(out);
                let title = match text("title") {
                    t if t.is_empty() => text("name"),
                    t => t,
                };
                let mark = match status.as_str() {
                    "completed" => s.green("✓"),
                    "failed" | "canceled" => s.red("✗"),
                    _ => s.dim("…"),
                };
                let _ = writeln!(out, "  {mark} {} {}", title, s.dim(&format!("[{status}]")));
                if let Some(err) = d["error"].as_str() {
                    let _ = writeln!(out, "    {}", s.red(err));
                }
            }
            "permission_requested" => {
                self.close_line(out);
                let options: Vec<String> = d["options"]
                    .as_array()
                    .map(|o| {
                        o.iter()
                            .map(|o| {
                                format!(
                                    "{} ({})",
                                    o["label"].as_str().unwrap_or(""),
                                    o["behavior"].as_str().unwrap_or("")
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "{} {} {}",
                    s.yellow("? permission:"),
                    text("title"),
                    s.dim(&format!(
                        "[request {}; options: {}]",
                        text("request_id"),
                        options.join(", ")
                    ))
                );
            }
            "permission_resolved" => {
                self.close_line(out);
                let _ = writeln!(
                    out,
                    "  {} {}",
                    s.dim("↳"),
                    s.dim(&format!("{} by {}", text("behavior"), text("resolved_by")))
                );
            }
            "error" => {
                self.close_line(out);
                let _ = writeln!(out, "{} {}", s.red("error:"), text("message"));
            }
            "network_denied" => {
                self.close_line(out);
                let _ = writeln!(
                    out,
                    "{} {}:{} {}",
                    s.yellow("network denied:"),
                    text("host"),
                    d["port"],
                    s.dim(&format!("[{}]", text("reason")))
                );
            }
            "turn_completed" => {
                self.close_line(out);
                let outcome = text("outcome");
                let line = match outcome.as_str() {
                    "completed" => s.green("— turn completed"),
                    _ => match d["error"].as_str() {
                        Some(err) => s.red(&format!("— turn {outcome}: {err}")),
                        None => s.red(&format!("— turn {outcome}")),
                    },
                };
                let _ = writeln!(out, "{line}");
            }
            "status" if !self.progress.is_drawn() => {
                // Progress for the person watching, kept off stdout (on a terminal the
                // spinner says it instead).
                let _ = writeln!(
                    std::io::stderr(),
                    "{}",
                    s.dim(&format!("[{}]", text("status")))
                );
            }
            _ => {}
        }
    }

    /// End an open line and take the spinner away (at the end of the output).
    pub fn finish(&mut self) {
        self.progress.hide();
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        self.close_line(&mut out);
        let _ = out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_connection_is_one_line() {
        let mut r = Renderer::new(Style { color: false }, false, Progress::off());
        let mut out = Vec::new();
        r.render(
            &serde_json::json!({"kind": "network_denied", "data": {"host": "blocked.example.com", "port": 443, "reason": "not_allowed"}}),
            &mut out,
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "network denied: blocked.example.com:443 [not_allowed]\n"
        );
    }
}
