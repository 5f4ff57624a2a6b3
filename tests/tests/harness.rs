//! A harness for real nodes: each one a `p2ptrain join` child process on 127.0.0.1 with an
//! OS-chosen API port and its own temporary data directory. Every process is killed when its
//! `Node` drops, so a failing test leaves nothing running. Nodes log at `info`; set
//! `P2PTRAIN_TEST_LOG` (an `RUST_LOG` filter) to see more.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The `p2ptrain` binary cargo built beside this test executable.
pub fn bin() -> PathBuf {
    crate::report::started();
    if let Ok(p) = std::env::var("P2PTRAIN_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/integration-<hash> -> target/<profile>/p2ptrain
    let profile_dir = exe.parent().and_then(Path::parent).expect("target dir");
    let bin = profile_dir.join("p2ptrain");
    assert!(
        bin.exists(),
        "{} not found: build it with `cargo build -p p2ptrain` (cargo test --workspace does)",
        bin.display()
    );
    bin
}

/// Skips a test whose prerequisite is missing: outside CI it prints why and the caller
/// returns; in CI (`CI=true`) a missing prerequisite is a failure, so a green CI run always
/// means every test really ran.
pub fn skip_or_fail(test: &str, why: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        panic!("{test}: prerequisite missing in CI: {why}");
    }
    eprintln!("SKIPPED {test}: {why}");
    crate::report::skipped(test, why);
}

/// The two cores, as the suite's tests share them. Tests that load both cores for minutes
/// (six-node meshes, the GPT) hold it shared: they may run beside each other and beside light
/// tests. Tests whose assertions depend on the CPU they get (a node throttled to half a core
/// whose classes must still spread, a link that must be saturated, pinned benchmark nodes,
/// lockstep members through a kill) hold it exclusively, so they never run beside a hog: a CI
/// run saw the demo's node 0 end at 79% (83-99% otherwise) beside the churn test's kills.
/// Light tests take neither. A test waiting for it holds a libtest thread, so the order tests
/// start in matters too (see `main.rs`).
static CORES: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Held for the whole of a test that loads both cores for minutes (see [`CORES`]).
pub fn cpu_hog() -> std::sync::RwLockReadGuard<'static, ()> {
    crate::report::started();
    let asked = Instant::now();
    let held = CORES
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    crate::report::waited(asked.elapsed());
    held
}

/// Held for the whole of a test whose assertions depend on the CPU it gets (see [`CORES`]).
pub fn cpu_sensitive() -> std::sync::RwLockWriteGuard<'static, ()> {
    crate::report::started();
    let asked = Instant::now();
    let held = CORES
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    crate::report::waited(asked.elapsed());
    held
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    crate::report::started();
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

/// The shared MNIST copy beside the checkout, if present.
pub fn mnist_dir() -> Option<PathBuf> {
    let dir = std::env::var("P2PTRAIN_MNIST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("../shared/data/mnist"));
    p2ptrain_models::data::mnist_present(&dir).then_some(dir)
}

/// Polls `f` until it returns `Some`, or panics with `what` after `timeout`.
pub fn eventually<T>(timeout: Duration, what: &str, f: impl FnMut() -> Option<T>) -> T {
    eventually_or_say(timeout, what, f, String::new)
}

/// [`eventually`], whose panic adds what `say` tells of the state waited on.
pub fn eventually_or_say<T>(
    timeout: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
    say: impl FnOnce() -> String,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}{}", say());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `p2ptrain eval --json` of `checkpoint` (with `config`, else the built-in default): the
/// held-out figures an offline reader gets. Asserts the command succeeded.
pub fn eval_json(checkpoint: &Path, config: Option<&Path>) -> serde_json::Value {
    let ck = checkpoint.to_str().expect("utf8");
    let mut args = vec!["eval", "--checkpoint", ck, "--json"];
    if let Some(c) = config {
        args.extend(["--config", c.to_str().expect("utf8")]);
    }
    let (st, out, err) = cli(&args, Duration::from_secs(120));
    assert!(st.success(), "eval failed: {err}");
    serde_json::from_str(&out).expect("eval json")
}

/// The repository's config `shipped` (e.g. `configs/text-gpt.toml`) with each `(from, to)`
/// replaced (each `from` must be there: a shipped config that changed fails loudly) and
/// `extra` TOML appended, written as `dir/name`.
pub fn edited_config(
    dir: &Path,
    name: &str,
    shipped: &str,
    replacements: &[(&str, &str)],
    extra: &str,
) -> PathBuf {
    let mut text = std::fs::read_to_string(repo_root().join(shipped)).expect("config");
    for (from, to) in replacements {
        assert!(text.contains(from), "{shipped}: {from}");
        text = text.replace(from, to);
    }
    text.push_str(extra);
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

/// Runs the CLI to completion with a time limit; returns (status, stdout, stderr).
pub fn cli(args: &[&str], timeout: Duration) -> (ExitStatus, String, String) {
    cli_in(None, args, timeout)
}

/// A command for the `p2ptrain` binary, inside network namespace `netns` if one is given
/// (`ip netns exec` execs the binary, so the child's pid is the binary's own).
fn command_in(netns: Option<&str>) -> Command {
    match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(bin());
            c
        }
        None => Command::new(bin()),
    }
}

/// [`cli`] inside a network namespace (where a node there serves its API on its own
/// loopback).
pub fn cli_in(
    netns: Option<&str>,
    args: &[&str],
    timeout: Duration,
) -> (ExitStatus, String, String) {
    cli_with(netns, args, timeout, |_| ())
}

/// [`cli_in`] with `during(pid)` called once the command has started; what it returns is
/// held until the command ends (a [`Throttle`] on one of its children, say).
pub fn cli_with<G>(
    netns: Option<&str>,
    args: &[&str],
    timeout: Duration,
    during: impl FnOnce(u32) -> G,
) -> (ExitStatus, String, String) {
    let dir = tempfile::tempdir().expect("tmp");
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = command_in(netns)
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("out"))
        .stderr(std::fs::File::create(&err).expect("err"))
        .spawn()
        .expect("spawn p2ptrain");
    let guard = during(child.id());
    let status = wait_with_timeout(&mut child, timeout).unwrap_or_else(|| {
        let _ = child.kill();
        let _ = child.wait();
        panic!("p2ptrain {args:?} did not finish within {timeout:?}");
    });
    drop(guard);
    (
        status,
        String::from_utf8_lossy(&std::fs::read(out).unwrap_or_default()).into_owned(),
        String::from_utf8_lossy(&std::fs::read(err).unwrap_or_default()).into_owned(),
    )
}

/// The nodes running now (started with [`Node::start`] or [`Node::start_in`]), killed by
/// [`clean_up_on_signals`]'s watcher if the suite is stopped by a signal (their `Node`s never
/// drop then). Processes a test runs through [`cli`] are not in it: they die with their pipes
/// or finish on their own; a `local` or benchmark run they start cleans up its own nodes on
/// SIGTERM only if it got one.
static CHILDREN: std::sync::Mutex<std::collections::BTreeSet<u32>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Once per process: a thread that, on SIGINT or SIGTERM (Ctrl-C, a CI timeout), kills every
/// node in [`CHILDREN`] and deletes this process's lab namespaces, then exits as the signal
/// would have (130 or 143). Without it a stopped suite left its nodes running and its
/// namespaces behind.
pub fn clean_up_on_signals() {
    static WATCHER: std::sync::Once = std::sync::Once::new();
    WATCHER.call_once(|| {
        let watch = || -> std::io::Result<()> {
            use tokio::signal::unix::{signal, SignalKind};
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (mut int, mut term) = {
                let _in_runtime = rt.enter();
                (
                    signal(SignalKind::interrupt())?,
                    signal(SignalKind::terminate())?,
                )
            };
            std::thread::spawn(move || {
                let code = rt.block_on(async {
                    tokio::select! {
                        _ = int.recv() => 130,
                        _ = term.recv() => 143,
                    }
                });
                let pids: Vec<u32> = CHILDREN
                    .lock()
                    .map(|p| p.iter().copied().collect())
                    .unwrap_or_default();
                for pid in &pids {
                    let _ = Command::new("kill").args(["-9", &pid.to_string()]).output();
                }
                let labs = p2ptrain_netlab::remove_labs_of(std::process::id());
                // Straight to the file descriptor: this thread inherits the test's output
                // capture, which `eprintln!` would write into and nobody would print.
                let _ = std::io::Write::write_all(
                    &mut std::io::stderr(),
                    format!(
                        "stopped by a signal: killed {} nodes, deleted {} lab namespaces\n",
                        pids.len(),
                        labs.len()
                    )
                    .as_bytes(),
                );
                std::process::exit(code);
            });
            Ok(())
        };
        if let Err(e) = watch() {
            eprintln!("cannot watch for signals ({e}): a stopped suite may leave nodes behind");
        }
    });
}

/// The pid of a child process of `parent` with `needle` among its arguments, once one runs.
pub fn child_with_arg(parent: u32, needle: &str) -> Option<u32> {
    children_with_arg(parent, needle).into_iter().next()
}

/// The pids of every child process of `parent` with `needle` among its arguments.
pub fn children_with_arg(parent: u32, needle: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            // /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces: split after ')'.
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let ppid: u32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let has = cmdline
                .split(|b| *b == 0)
                .any(|arg| String::from_utf8_lossy(arg).contains(needle));
            (ppid == parent && has).then_some(pid)
        })
        .collect()
}

/// A process slowed as on an overloaded box: SIGSTOP for `stopped` of every `period`, then
/// SIGCONT, from a thread, until dropped (which leaves it running). Its connections stay up;
/// it just gets a fraction of the CPU.
pub struct Throttle {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Throttle {
    /// Starts throttling `pid`.
    pub fn start(pid: u32, stopped: Duration, period: Duration) -> Throttle {
        use std::sync::atomic::{AtomicBool, Ordering};
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        let signal = move |sig: &str| {
            Command::new("kill")
                .args([sig, &pid.to_string()])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                if !signal("-STOP") {
                    return; // the process is gone
                }
                std::thread::sleep(stopped);
                signal("-CONT");
                std::thread::sleep(period.saturating_sub(stopped));
            }
        });
        Throttle {
            done,
            thread: Some(thread),
        }
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn wait_with_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One running node.
pub struct Node {
    child: Option<Child>,
    /// Its data directory.
    pub data_dir: PathBuf,
    /// Where its stderr goes.
    pub log: PathBuf,
    /// Its API address once known.
    pub api: Option<String>,
    /// The network namespace it runs in, if not the test's own.
    pub netns: Option<String>,
    _logs: tempfile::TempDir,
}

impl Node {
    /// Starts `p2ptrain join` on `data_dir` with an OS-chosen API port and extra arguments.
    pub fn start(data_dir: &Path, extra: &[&str]) -> Node {
        Node::start_in(None, "/ip4/127.0.0.1/tcp/0", data_dir, extra)
    }

    /// [`Node::start`] inside network namespace `netns` (if given), listening on `listen`.
    pub fn start_in(netns: Option<&str>, listen: &str, data_dir: &Path, extra: &[&str]) -> Node {
        let logs = tempfile::tempdir().expect("log dir");
        let log = logs.path().join("stderr.log");
        // A stale address file from a killed predecessor must not be mistaken for ours.
        let _ = std::fs::remove_file(data_dir.join("api.addr"));
        let mut args = vec![
            "join",
            "--data-dir",
            data_dir.to_str().expect("utf8"),
            "--api",
            "127.0.0.1:0",
            "--listen",
            listen,
        ];
        args.extend_from_slice(extra);
        let child = command_in(netns)
            .args(&args)
            .env(
                "RUST_LOG",
                std::env::var("P2PTRAIN_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn p2ptrain join");
        clean_up_on_signals();
        if let Ok(mut pids) = CHILDREN.lock() {
            pids.insert(child.id());
        }
        Node {
            child: Some(child),
            data_dir: data_dir.to_path_buf(),
            log,
            api: None,
            netns: netns.map(String::from),
            _logs: logs,
        }
    }

    /// Runs the CLI where this node runs (its namespace), against its API.
    pub fn cli(&self, args: &[&str], timeout: Duration) -> (ExitStatus, String, String) {
        let api = self.api.as_deref().expect("the node's API is known");
        let mut all = args.to_vec();
        all.extend(["--api", api]);
        cli_in(self.netns.as_deref(), &all, timeout)
    }

    /// The process id, while the node runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Resident memory of the process in KiB (Linux `/proc`), all of it (`VmRSS`).
    pub fn rss_kib(&self) -> Option<u64> {
        self.proc_status_kib("VmRSS")
    }

    /// The process's peak resident memory so far (`VmHWM`), in KiB.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        self.proc_status_kib("VmHWM")
    }

    /// One `kB` field of the process's `/proc/PID/status`.
    fn proc_status_kib(&self, field: &str) -> Option<u64> {
        let pid = self.child.as_ref()?.id();
        let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// Waits until the node serves its API; returns the address.
    pub fn wait_api(&mut self) -> String {
        let file = self.data_dir.join("api.addr");
        let api = eventually(Duration::from_secs(60), "the node's API address", || {
            if let Some(s) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("node exited early ({s}); log:\n{}", self.log_text());
            }
            std::fs::read_to_string(&file)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        });
        self.api = Some(api.clone());
        api
    }

    /// The node's stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The node's status, or None if it does not answer: over HTTP from the test process when
    /// the node shares its namespace (a CLI process per poll, hundreds in a churn run, would
    /// add load to what is under test), else `p2ptrain status --json` run in the node's
    /// namespace, whose loopback the test cannot reach: the lab tests (`partition`, `nat`)
    /// are the ones that still exercise the CLI's `status --json`.
    pub fn status(&self) -> Option<Value> {
        self.api.as_deref()?;
        if self.netns.is_none() {
            return self.status_http();
        }
        let (st, out, _) = self.cli(&["status", "--json"], Duration::from_secs(20));
        if !st.success() {
            return None;
        }
        serde_json::from_str(&out).ok()
    }

    /// The status straight over HTTP from the test process, or None if the node does not
    /// answer within 5 s: cheap enough to poll a whole mesh every second without adding a
    /// CLI process per poll to the load under test. Only for nodes in the test's namespace.
    pub fn status_http(&self) -> Option<Value> {
        serde_json::from_str(&self.http_get("/v1/status")?).ok()
    }

    /// The body of `GET path` on the node's API if it answers 200 within 5 s. Only for nodes
    /// in the test's namespace.
    pub fn http_get(&self, path: &str) -> Option<String> {
        use std::io::{Read, Write};
        let api = self.api.as_deref()?;
        let addr: std::net::SocketAddr = api.parse().ok()?;
        let mut conn = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
        conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        let token = self.api_token().unwrap_or_default();
        conn.write_all(
            format!("GET {path} HTTP/1.0\r\nHost: {api}\r\nAuthorization: Bearer {token}\r\n\r\n")
                .as_bytes(),
        )
        .ok()?;
        let mut reply = String::new();
        conn.read_to_string(&mut reply).ok()?;
        let (head, body) = reply.split_once("\r\n\r\n")?;
        if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
            return None;
        }
        Some(body.to_string())
    }

    /// The API's access token, which the node keeps in its data directory.
    pub fn api_token(&self) -> Option<String> {
        std::fs::read_to_string(self.data_dir.join("api.token"))
            .ok()
            .map(|t| t.trim().to_string())
    }

    /// Waits until status satisfies `pred`. On a timeout the panic names the node and shows
    /// its last status (its log's tail follows as the node drops): a wait that fails once in
    /// many runs must say which node it waited on and what that node reported.
    pub fn wait_status(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let last = std::cell::RefCell::new(None);
        eventually_or_say(
            timeout,
            what,
            || {
                let s = self.status()?;
                if pred(&s) {
                    return Some(s);
                }
                *last.borrow_mut() = Some(s);
                None
            },
            || {
                format!(
                    " on the node in {}; its last status: {}",
                    self.data_dir.display(),
                    last.borrow()
                        .as_ref()
                        .map_or_else(|| "none".to_string(), Value::to_string)
                )
            },
        )
    }

    /// SIGKILL, as a crash.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            if let Ok(mut pids) = CHILDREN.lock() {
                pids.remove(&c.id());
            }
        }
    }

    /// SIGSTOP: the box hangs without closing its connections, so peers only notice by the
    /// ping timeout (a kill on loopback resets the connections at once). Dropping the node
    /// still kills it.
    pub fn freeze(&self) {
        let pid = self.child.as_ref().expect("node running").id();
        let st = Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .expect("kill -STOP");
        assert!(st.success(), "kill -STOP {pid} failed");
    }

    /// Waits for the process to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let mut child = self.child.take().expect("node already reaped");
        if let Ok(mut pids) = CHILDREN.lock() {
            pids.remove(&child.id());
        }
        match wait_with_timeout(&mut child, timeout) {
            Some(s) => s,
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "node did not exit within {timeout:?}; log:\n{}",
                    self.log_text()
                );
            }
        }
    }
}

impl Drop for Node {
    /// Kills the node; when the test is failing, its log's tail goes to the test's output
    /// first (the log's directory goes away with the node, and CI keeps only that output).
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            let log = self.log_text();
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
            eprintln!(
                "---- log of the node in {} (last {} lines) ----\n{}",
                self.data_dir.display(),
                tail.len(),
                tail.join("\n")
            );
        }
    }
}

/// Lines of a node's log a failing test prints. 60 cut off what explained stop 47's CI
/// failure (a `ring_rogue` `diloco` test: the honest members' sit-outs came minutes of
/// round logs earlier); a failing four-node test now prints some 1,600 lines.
const LOG_TAIL_LINES: usize = 400;

/// A checkpoint as an independent reader sees it: metadata, and tensors as (shape, values).
pub type CheckpointContents = (
    std::collections::HashMap<String, String>,
    std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>,
);

/// Reads a checkpoint file with the independent `safetensors` crate (no Candle).
pub fn read_checkpoint(path: &Path) -> CheckpointContents {
    let bytes = std::fs::read(path).expect("read checkpoint");
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).expect("header");
    let meta = header.metadata().clone().expect("metadata");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut tensors = std::collections::BTreeMap::new();
    for (name, view) in st.tensors() {
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
        let values = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        tensors.insert(name, (view.shape().to_vec(), values));
    }
    (meta, tensors)
}

/// The newest checkpoint file in a data directory.
pub fn newest_checkpoint(data_dir: &Path) -> Option<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(data_dir.join("checkpoints"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    files.pop()
}

/// The median held-out accuracy of the evaluations a node in `data_dir` logged in the
/// `window` before its last one: a skewed node's accuracy swings from one evaluation to the
/// next (0.55-0.98 within seconds), so one figure, such as the final checkpoint's, is a noisy
/// sample of what the mesh taught it.
pub fn recent_median_accuracy(data_dir: &Path, window: Duration) -> f64 {
    let window_ms = window.as_millis() as u64;
    let evals: Vec<(u64, f64)> = evals(data_dir)
        .iter()
        .filter_map(|e| Some((e["unix_ms"].as_u64()?, e["accuracy"].as_f64()?)))
        .collect();
    let end = evals
        .iter()
        .map(|e| e.0)
        .max()
        .unwrap_or_else(|| panic!("{} logged no evaluation", data_dir.display()));
    let mut recent: Vec<f64> = evals
        .iter()
        .filter(|e| e.0 + window_ms >= end)
        .map(|e| e.1)
        .collect();
    assert!(
        recent.len() >= 3,
        "{}: {} evaluations in the last {window:?}, too few for a median",
        data_dir.display(),
        recent.len()
    );
    recent.sort_by(f64::total_cmp);
    let half = recent.len() / 2;
    if recent.len().is_multiple_of(2) {
        (recent[half - 1] + recent[half]) / 2.0
    } else {
        recent[half]
    }
}

/// Every evaluation a node logged (`evals.jsonl` in its data directory), oldest first: each
/// with its step and figures, where a status poll sees only the latest.
pub fn evals(data_dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(data_dir.join("evals.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}
