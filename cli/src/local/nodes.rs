//! The node processes `local` (and `bench scaling`) start: their flags, core sets, the wait
//! for their control API, the guard that kills them, and what they leave on disk (evaluation
//! logs, final parameters).

use super::*;

/// How long a run to a target may take, the mesh and the lone control each, when no
/// `--duration` says.
pub(super) const TARGET_TIMEOUT: Duration = Duration::from_secs(600);

/// Milliseconds since the Unix epoch: evaluation logs are stamped so.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Every evaluation a node logged, oldest first (`evals.jsonl` in its data directory).
pub(crate) fn read_evals(dir: &Path) -> Vec<EvalRecord> {
    std::fs::read_to_string(dir.join(p2ptrain_daemon::node::EVAL_LOG))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The first of a node's evaluations since `started_ms` that reached `target`, timed from
/// then.
pub(super) fn first_at_target(dir: &Path, target: Option<f64>, started_ms: u64) -> Option<Reached> {
    read_evals(dir)
        .iter()
        // A reused data directory keeps an earlier run's evaluations: not this run's.
        .filter(|e| e.unix_ms >= started_ms)
        .find(|e| reaches_target(target, e.accuracy, e.bits_per_byte))
        .map(|e| Reached {
            step: e.step,
            secs: e.unix_ms.saturating_sub(started_ms) as f64 / 1e3,
        })
}

/// Every local node's control API: loopback, a port the OS picks.
pub(super) const LOCAL_API: &str = "127.0.0.1:0";

/// Every local node's libp2p address: loopback, a port the OS picks.
pub(super) const LOCAL_LISTEN: &str = "/ip4/127.0.0.1/tcp/0";
/// The control API's status path.
pub(super) const STATUS: &str = "/v1/status";

/// Child processes that are killed if this guard drops before they exit.
pub(crate) struct Children(pub(crate) Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The `join` flags one node starts with, beside its data directory and config.
#[derive(Clone, Copy, Default)]
pub(super) struct NodeFlags<'a> {
    /// `--shard k/n`.
    pub(super) shard: Option<&'a str>,
    /// `--max-steps`.
    pub(super) steps: Option<u64>,
    /// `--bootstrap`: none for the founder and for a lone node.
    pub(super) bootstrap: Option<&'a str>,
    /// `--sync-mode`.
    pub(super) sync_mode: Option<&'a str>,
    /// `--min-members`: the mesh's size, so a synchronous mode starts with every node from
    /// one state, and a gossip node takes its first step once it hears the others (at most
    /// `degree` of them).
    pub(super) min_members: Option<usize>,
    /// `--target`: the node logs when it first reaches it.
    pub(super) target: Option<f64>,
}

pub(super) fn spawn_node(
    dir: &Path,
    config: Option<&Path>,
    flags: NodeFlags<'_>,
    cores: Option<&str>,
) -> Result<Child> {
    p2ptrain_daemon::node::make_private_dir(dir)
        .with_context(|| format!("cannot create {}", dir.display()))?;
    let log =
        std::fs::File::create(dir.with_extension("log")).context("cannot create a node log")?;
    let exe = std::env::current_exe().context("cannot find this executable")?;
    // `taskset` execs what follows, so the child is the node itself.
    let mut cmd = match cores {
        Some(c) => {
            let mut cmd = Command::new("taskset");
            cmd.args(["-c", c]).arg(exe);
            cmd
        }
        None => Command::new(exe),
    };
    cmd.arg("join")
        .arg("--data-dir")
        .arg(dir)
        .args(["--api", LOCAL_API, "--listen", LOCAL_LISTEN]);
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    if let Some(s) = flags.shard {
        cmd.args(["--shard", s]);
    }
    if let Some(s) = flags.steps {
        cmd.args(["--max-steps", &s.to_string()]);
    }
    if let Some(b) = flags.bootstrap {
        cmd.args(["--bootstrap", b]);
    }
    if let Some(m) = flags.sync_mode {
        cmd.args(["--sync-mode", m]);
    }
    if let Some(m) = flags.min_members {
        cmd.args(["--min-members", &m.to_string()]);
    }
    if let Some(t) = flags.target {
        cmd.args(["--target", &t.to_string()]);
    }
    if let Some(c) = cores {
        cmd.args(["--threads", &c.split(',').count().to_string()]);
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
    stop_with_parent(&mut cmd);
    cmd.spawn().with_context(|| {
        format!(
            "cannot start a node{}",
            if cores.is_some() {
                " under taskset (is util-linux installed?)"
            } else {
                ""
            }
        )
    })
}

/// The cores of core set `k` of `per` cores each, as `taskset -c` takes them.
pub(crate) fn core_set(k: usize, per: usize) -> String {
    (k * per..(k + 1) * per)
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Fails unless this machine has `sets` sets of `per` cores each: pinning two nodes to one
/// core would measure contention, not what another box buys.
pub(crate) fn check_core_sets(sets: usize, per: usize) -> Result<()> {
    if per == 0 {
        bail!("--cores-per-node must be at least 1");
    }
    let available = std::thread::available_parallelism().map_or(1, usize::from);
    if sets * per > available {
        bail!(
            "{sets} nodes of {per} cores each need {} cores; this machine offers {available}",
            sets * per
        );
    }
    Ok(())
}

/// How long a node may take to start (its API address written, its listen address known).
pub(crate) const START_WAIT: Duration = Duration::from_secs(120);

/// An error once a starting node has exited, or once `deadline` has passed, naming its log;
/// the start-up waits of `local` and `bench scaling` call it between their polls.
pub(crate) fn check_starting(child: &mut Child, log: &Path, deadline: Instant) -> Result<()> {
    if let Some(status) = child.try_wait()? {
        bail!(
            "a node exited during start-up ({status}); see {}",
            log.display()
        );
    }
    if Instant::now() > deadline {
        bail!(
            "a node did not start within {} s; see {}",
            START_WAIT.as_secs(),
            log.display()
        );
    }
    Ok(())
}

pub(super) async fn wait_api(dir: &Path, child: &mut Child) -> Result<String> {
    let file = dir.join(p2ptrain_daemon::node::API_ADDR_FILE);
    let deadline = Instant::now() + START_WAIT;
    loop {
        if let Ok(s) = std::fs::read_to_string(&file) {
            if !s.trim().is_empty() {
                return Ok(s.trim().to_string());
            }
        }
        check_starting(child, &dir.with_extension("log"), deadline)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(super) fn relative_distance(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        d += f64::from(x - y).powi(2);
        n += f64::from(*y).powi(2);
    }
    d.sqrt() / n.sqrt().max(f64::MIN_POSITIVE)
}

/// Flat parameters (no optimizer state) of the newest checkpoint in a node's data dir.
pub(super) fn final_params(dir: &Path) -> Option<(PathBuf, Vec<f32>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("checkpoints"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    let file = files.pop()?;
    let bytes = std::fs::read(&file).ok()?;
    let (_, tensors) = p2ptrain_daemon::checkpoint::decode(&bytes, "final").ok()?;
    let flat = tensors
        .iter()
        .filter(|(name, _)| !name.starts_with("optim."))
        .flat_map(|(_, t)| t.values.iter().copied())
        .collect();
    Some((file, flat))
}

/// Has the kernel send the child SIGTERM when this process dies, however it dies: a
/// `local` stopped by SIGTERM (whose default action runs no destructor, so [`Children`]
/// never kills them) or killed outright took no node with it, and its nodes trained on as
/// orphans. A node stops on SIGTERM as on Ctrl-C, with a final checkpoint. (The signal
/// follows the thread that spawned the child: `local` spawns its nodes from its main
/// thread, which lives as long as it does.)
#[allow(unsafe_code)] // `pre_exec` is unsafe: the one place `local` needs it.
fn stop_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: between fork and exec only async-signal-safe calls are made: prctl and
    // getppid, no allocation, no lock.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // This process may have died before the call: then nobody would send it.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other("local exited while starting a node"));
            }
            Ok(())
        });
    }
}
