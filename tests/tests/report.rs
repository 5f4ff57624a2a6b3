//! What the suite says when it ends, after libtest's own summary, where a user running
//! `cargo test --workspace` looks: each test's time, slowest first, its run apart from its wait
//! for the cores' lock (see `harness::CORES`), and every test that
//! skipped for a missing prerequisite, with why (libtest shows a skipped test as `ok` and hides
//! its output).
//!
//! A test is timed from its first call into the harness (which every test makes as it starts:
//! the binary's path, a node, a lock, a skip) until its thread ends, its nodes stopped.

use std::cell::Cell;
use std::io::Write;
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

/// Each ended test: its name, its wall time and how much of it went waiting for the cores.
static TIMES: Mutex<Vec<(String, Duration, Duration)>> = Mutex::new(Vec::new());
static SKIPPED: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());
static AT_EXIT: Once = Once::new();

/// The running test's clock; it records the test's time when the test's thread ends.
struct TestClock {
    name: String,
    started: Instant,
    /// Time spent waiting for the cores' lock.
    waited: Cell<Duration>,
}

impl Drop for TestClock {
    fn drop(&mut self) {
        if let Ok(mut times) = TIMES.lock() {
            times.push((
                std::mem::take(&mut self.name),
                self.started.elapsed(),
                self.waited.get(),
            ));
        }
    }
}

thread_local! {
    static CLOCK: TestClock = TestClock {
        // libtest names each test's thread after the test.
        name: std::thread::current().name().unwrap_or("?").to_string(),
        started: Instant::now(),
        waited: Cell::new(Duration::ZERO),
    };
}

/// Starts the calling test's clock (once per test) and arranges the summary at exit.
pub fn started() {
    AT_EXIT.call_once(print_at_exit);
    CLOCK.with(|_| {});
}

/// Counts `waited` (for the cores' lock) as the calling test's wait, not its run.
pub fn waited(waited: Duration) {
    started();
    CLOCK.with(|c| c.waited.set(c.waited.get() + waited));
}

/// Notes that `test` ran nothing because `why`.
pub fn skipped(test: &str, why: &str) {
    started();
    if let Ok(mut s) = SKIPPED.lock() {
        s.push((test.to_string(), why.to_string()));
    }
}

#[allow(unsafe_code)]
fn print_at_exit() {
    extern "C" {
        fn atexit(callback: extern "C" fn()) -> std::os::raw::c_int;
    }
    // SAFETY: C's atexit only stores the pointer of a function that takes no arguments;
    // `summary` never unwinds into C (it catches every panic) and reads only Rust statics.
    unsafe {
        atexit(summary);
    }
}

extern "C" fn summary() {
    let _ = std::panic::catch_unwind(|| {
        let mut err = std::io::stderr().lock();
        let times = TIMES.lock().map(|t| t.clone()).unwrap_or_default();
        // Each test's run (its wall time less its wait for the cores) and its wait.
        let mut runs: Vec<(&str, f64, f64)> = times
            .iter()
            .map(|(name, wall, waited)| {
                let waited = waited.min(wall).as_secs_f64();
                (name.as_str(), wall.as_secs_f64() - waited, waited)
            })
            .collect();
        runs.sort_by(|a, b| b.1.total_cmp(&a.1));
        let run_total: f64 = runs.iter().map(|r| r.1).sum();
        let wait_total: f64 = runs.iter().map(|r| r.2).sum();
        let _ = writeln!(
            err,
            "\n== integration tests' times, slowest run first ({} tests, {run_total:.0} s running \
             and {wait_total:.0} s waiting for the cores together)",
            runs.len()
        );
        for (name, run, waited) in &runs {
            let _ = writeln!(err, "{run:>8.1} s run {waited:>6.1} s wait  {name}");
        }
        let skipped = SKIPPED.lock().map(|s| s.clone()).unwrap_or_default();
        if skipped.is_empty() {
            let _ = writeln!(err, "== skipped: none");
        } else {
            let _ = writeln!(
                err,
                "== SKIPPED {} tests, which ran nothing (with CI=true they fail):",
                skipped.len()
            );
            for (test, why) in &skipped {
                let _ = writeln!(err, "   {test}: {why}");
            }
        }
    });
}
