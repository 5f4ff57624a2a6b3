//! Progress of long work for people: bars (indicatif) when stderr is a terminal, plain lines
//! now and then when it is not (a log file, CI), so neither gets the other's form.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

/// Least time between two plain progress lines.
const LINE_EVERY: Duration = Duration::from_secs(2);

/// Whether progress goes to a terminal (bars) rather than a file (lines).
pub fn on_terminal() -> bool {
    std::io::stderr().is_terminal()
}

/// A style from a template known to be valid; the default style if it is not.
fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar())
}

/// Counted work (`done` of `total` units): a bar on a terminal, else a line every few seconds
/// and one at the end.
pub struct Counted {
    label: String,
    total: u64,
    bar: Option<ProgressBar>,
    last_line: Option<Instant>,
    bytes: bool,
}

impl Counted {
    /// Work of `total` items.
    pub fn items(label: &str, total: u64) -> Counted {
        Counted::new(label, total, false)
    }

    /// Work of `total` bytes.
    pub fn bytes(label: &str, total: u64) -> Counted {
        Counted::new(label, total, true)
    }

    fn new(label: &str, total: u64, bytes: bool) -> Counted {
        let bar = on_terminal().then(|| {
            let bar = ProgressBar::new(total);
            let counts = if bytes {
                "{bytes}/{total_bytes} {bytes_per_sec}"
            } else {
                "{pos}/{len}"
            };
            bar.set_style(style(&format!(
                "{{prefix}} [{{bar:30}}] {counts} {{elapsed_precise}} {{msg}}"
            )));
            bar.set_prefix(label.to_string());
            bar
        });
        Counted {
            label: label.to_string(),
            total,
            bar,
            last_line: None,
            bytes,
        }
    }

    /// Sets how much is done, with a short note on what is under way.
    pub fn set(&mut self, done: u64, note: &str) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(done);
                bar.set_message(note.to_string());
            }
            None => {
                if self.last_line.is_none_or(|t| t.elapsed() >= LINE_EVERY) {
                    self.line(done, note);
                }
            }
        }
    }

    /// Prints a line of results: above the bar on a terminal, as it is otherwise.
    pub fn println(&self, line: String) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    /// Sets how much is done with no plain line (the caller's own lines say it), for work
    /// whose every step prints results.
    pub fn set_quietly(&mut self, done: u64, note: &str) {
        if let Some(bar) = &self.bar {
            bar.set_position(done);
            bar.set_message(note.to_string());
        }
    }

    fn line(&mut self, done: u64, note: &str) {
        let counts = if self.bytes {
            format!(
                "{} of {}",
                crate::output::human_bytes(done as f64),
                crate::output::human_bytes(self.total as f64)
            )
        } else {
            format!("{done}/{}", self.total)
        };
        eprintln!("{}: {counts} {note}", self.label);
        self.last_line = Some(Instant::now());
    }

    /// The work was given up at `done`.
    pub fn abandon(mut self, done: u64) {
        match self.bar.take() {
            Some(bar) => bar.abandon_with_message("given up"),
            None => self.line(done, "given up"),
        }
    }

    /// The work is done (or abandoned at `done`).
    pub fn finish(mut self, done: u64) {
        match self.bar.take() {
            Some(bar) => {
                bar.set_position(done);
                bar.finish_and_clear();
            }
            None => self.line(done, "done"),
        }
    }
}

/// One line of status per node of a local mesh, redrawn in place on a terminal. Off a terminal
/// it draws nothing: the caller prints its own plain lines.
pub struct NodeLines {
    _multi: MultiProgress,
    lines: Vec<ProgressBar>,
}

impl NodeLines {
    /// Lines for `nodes` nodes, if stderr is a terminal.
    pub fn new(nodes: usize) -> Option<NodeLines> {
        if !on_terminal() {
            return None;
        }
        let multi = MultiProgress::new();
        let lines = (0..nodes)
            .map(|i| {
                let line = multi.add(ProgressBar::new_spinner());
                line.set_style(style("{spinner} {prefix} {msg}"));
                line.set_prefix(format!("node {i}"));
                line.enable_steady_tick(Duration::from_millis(200));
                line
            })
            .collect();
        Some(NodeLines {
            _multi: multi,
            lines,
        })
    }

    /// Sets node `i`'s line.
    pub fn set(&self, i: usize, text: String) {
        if let Some(line) = self.lines.get(i) {
            line.set_message(text);
        }
    }
}

impl Drop for NodeLines {
    fn drop(&mut self) {
        for line in &self.lines {
            line.finish_and_clear();
        }
    }
}
