//! What a person at a terminal sees while the client waits: a spinner with a status line
//! on stderr (what the agent is doing, how long it has been going). Only when stderr is a
//! terminal that can redraw a line (not `TERM=dumb`); coloured only without `NO_COLOR`.
//! Piped, nothing is drawn and status changes are plain lines instead.
//!
//! The spinner shares the terminal with the conversation printed on stdout, so every
//! print goes through [`Progress::print`], which takes the spinner line away while the
//! text goes out. While a streamed message's line is still open (its text arrives in
//! chunks with no newline yet) the spinner stays away, since redrawing it would land in
//! the middle of that line.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// Frames of the spinner (braille dots, as most terminal tools draw them).
const FRAMES: &[&str] = &["⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧", "⠇", "⠏", "·"];
const TICK: Duration = Duration::from_millis(100);

pub struct Progress {
    /// Whether a spinner may be drawn at all.
    enabled: bool,
    color: bool,
    /// The spinner while it is on screen.
    bar: Option<ProgressBar>,
    message: String,
    started: Instant,
}

impl Progress {
    /// A spinner on stderr when stderr is a terminal, else none.
    pub fn detect() -> Self {
        let dumb = std::env::var_os("TERM").is_some_and(|t| t == "dumb");
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        let enabled = std::io::stderr().is_terminal() && !dumb;
        Self {
            enabled,
            color: enabled && !no_color,
            bar: None,
            message: String::new(),
            started: Instant::now(),
        }
    }

    /// No spinner (for `--json` and commands that do not wait).
    pub fn off() -> Self {
        Self {
            enabled: false,
            color: false,
            bar: None,
            message: String::new(),
            started: Instant::now(),
        }
    }

    /// Whether status goes to the spinner (true) or out as lines (false).
    pub fn is_drawn(&self) -> bool {
        self.enabled
    }

    /// Put the spinner on screen (again), with the current message.
    pub fn show(&mut self) {
        if !self.enabled || self.bar.is_some() {
            return;
        }
        let template = if self.color {
            "{spinner:.cyan} {msg} {elapsed:.dim}"
        } else {
            "{spinner} {msg} {elapsed}"
        };
        let style = ProgressStyle::with_template(template)
            .expect("a valid template")
            .tick_strings(FRAMES);
        let bar = ProgressBar::new_spinner()
            .with_style(style)
            .with_elapsed(self.started.elapsed())
            .with_message(self.message.clone());
        bar.enable_steady_tick(TICK);
        self.bar = Some(bar);
    }

    /// Take the spinner off the screen until [`Progress::show`].
    pub fn hide(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }

    /// What the spinner says.
    pub fn set_message(&mut self, message: impl Into<String>) {
        self.message = message.into();
        if let Some(bar) = &self.bar {
            bar.set_message(self.message.clone());
        }
    }

    /// Run `f` (which prints) with the spinner out of the way.
    pub fn print<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.hide();
    }
}
