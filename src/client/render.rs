//! How events look in a terminal: the conversation on stdout (assistant text as it
//! streams, tool calls, permission requests, the end of each turn), agent status changes
//! on stderr; colour only on a terminal and never with `NO_COLOR`. With `--json`, each
//! event is the API's own object on one line.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};

use serde_json::Value;

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
}

impl Renderer {
    pub fn new(style: Style, json: bool) -> Self {
        Self {
            style,
            json,
            open_message: None,
            streamed: Default::default(),
            tools: HashMap::new(),
        }
    }

    fn close_line(&mut self, out: &mut impl Write) {
        if self.open_message.take().is_some() {
            let _ = writeln!(out);
        }
    }

    pub fn event(&mut self, e: &Value) {
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        if self.json {
            let _ = writeln!(out, "{e}");
            let _ = out.flush();
            return;
        }
        let s = self.style;
        let d = &e["data"];
        let text = |k: &str| d[k].as_str().unwrap_or("").to_owned();
        match e["kind"].as_str().unwrap_or("") {
            "user_message" => {
                self.close_line(&mut out);
                let _ = writeln!(out, "{} {}", s.bold(">"), s.bold(&text("text")));
            }
            "assistant_delta" => {
                let id = text("message_id");
                if self.open_message.as_deref() != Some(id.as_str()) {
                    self.close_line(&mut out);
                    self.open_message = Some(id.clone());
                }
                self.streamed.insert(id);
                let _ = write!(out, "{}", text("text"));
            }
            "assistant_message" => {
                let id = text("message_id");
                if self.streamed.remove(&id) {
                    self.close_line(&mut out);
                } else {
                    self.close_line(&mut out);
                    let _ = writeln!(out, "{}", text("text"));
                }
            }
            "reasoning" => {
                self.close_line(&mut out);
                let _ = writeln!(out, "{}", s.dim(&format!("(thinking) {}", text("text"))));
            }
            "tool_call" => {
                let id = text("call_id");
                let status = text("status");
                if self.tools.get(&id) == Some(&status) {
                    return;
                }
                self.tools.insert(id, status.clone());
                self.close_line(&mut out);
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
                self.close_line(&mut out);
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
                self.close_line(&mut out);
                let _ = writeln!(
                    out,
                    "  {} {}",
                    s.dim("↳"),
                    s.dim(&format!("{} by {}", text("behavior"), text("resolved_by")))
                );
            }
            "error" => {
                self.close_line(&mut out);
                let _ = writeln!(out, "{} {}", s.red("error:"), text("message"));
            }
            "turn_completed" => {
                self.close_line(&mut out);
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
            "status" => {
                // Progress for the person watching, kept off stdout.
                let _ = writeln!(
                    std::io::stderr(),
                    "{}",
                    s.dim(&format!("[{}]", text("status")))
                );
            }
            _ => {}
        }
        let _ = out.flush();
    }

    /// End an open line (at the end of the output).
    pub fn finish(&mut self) {
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        self.close_line(&mut out);
        let _ = out.flush();
    }
}
