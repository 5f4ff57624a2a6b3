//! What the suite says when it ends, after libtest's own summary, where a user running
//! `cargo test --workspace` looks: each test's wall time, slowest first, and every test that
//! skipped for a missing prerequisite, with why (libtest shows a skipped test as `ok` and hides
//! its output).
//!
//! A test is timed from its first call into the harness (which every test makes as it starts:
//! the binary's path, a node, a lock, a skip) until its thread ends, its nodes stopped.

use std::io::Write;
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

static TIMES: Mutex<Vec<(String, Duration)>> = Mutex::new(Vec::new());
static SKIPPED: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());
static AT_EXIT: Once = Once::new();

/// The running test's clock; it records the test's time when the test's thread ends.
struct TestClock {
    name: String,
    started: Instant,
}

impl Drop for TestClock {
    fn drop(&mut self) {
        if let Ok(mut times) = TIMES.lock() {
            times.push((std::mem::take(&mut self.name), self.started.elapsed()));
        }
    }
}

thread_local! {
    static CLOCK: TestClock = TestClock {
        // libtest names each test's thread after the test.
        name: std::thread::current().name().unwrap_or("?").to_string(),
        started: Instant::now(),
    };
}

/// Starts the calling test's clock (once per test) and arranges the summary at exit.
pub fn started() {
    AT_EXIT.call_once(print_at_exit);
    CLOCK.with(|_| {});
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
        let mut times = TIMES.lock().map(|t| t.clone()).unwrap_or_default();
        times.sort_by_key(|(_, d)| std::cmp::Reverse(*d));
        let total: f64 = times.iter().map(|(_, d)| d.as_secs_f64()).sum();
        let _ = writeln!(
            err,
            "\n== integration tests' wall times, slowest first ({} tests, {total:.0} s together)",
            times.len()
        );
        for (name, d) in &times {
            let _ = writeln!(err, "{:>8.1} s  {name}", d.as_secs_f64());
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
