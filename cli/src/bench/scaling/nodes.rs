//! The p2ptrain nodes a run starts (on loopback or on a lab's hosts), their status and their
//! listen address.

use super::*;
use p2ptrain_daemon::control::token;

pub(super) fn spawn(
    bench: &Bench,
    arm: &Arm,
    k: usize,
    dir: &Path,
    config: &Path,
    boot: Option<&str>,
) -> Result<Child> {
    p2ptrain_daemon::node::make_private_dir(dir)?;
    let log = std::fs::File::create(dir.join("node.log"))?;
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let listen = match (&bench.lab, arm) {
        (Some((lab, _)), Arm::Mesh(_)) => lab.listen(k),
        _ => "/ip4/127.0.0.1/tcp/0".to_string(),
    };
    let mut cmd = bench.pinned(arm, k, &exe);
    cmd.arg("join")
        .arg("--data-dir")
        .arg(dir)
        .arg("--config")
        .arg(config)
        .args(["--api", "127.0.0.1:0", "--listen", &listen]);
    if let Some(b) = boot {
        cmd.args(["--bootstrap", b]);
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
    cmd.spawn()
        .context("cannot start a node under taskset (is util-linux installed?)")
}

/// Status of the node whose data directory is `dir`, over its API (from inside its lab
/// host's namespace when it has one: this process cannot reach that host's loopback).
pub(super) fn status(dir: &Path, netns: Option<&str>) -> Option<serde_json::Value> {
    let addr = std::fs::read_to_string(dir.join(p2ptrain_daemon::node::API_ADDR_FILE)).ok()?;
    let addr = addr.trim();
    if let Some(ns) = netns {
        let exe = std::env::current_exe().ok()?;
        let out = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(exe)
            .args(["status", "--json", "--api", addr])
            .env(
                p2ptrain_daemon::control::TOKEN_ENV,
                token::read(dir).unwrap_or_default(),
            )
            .output()
            .ok()?;
        return serde_json::from_slice(&out.stdout).ok();
    }
    let url = format!("http://{addr}/v1/status");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    rt.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .ok()?;
        client
            .get(url)
            .bearer_auth(token::read(dir).unwrap_or_default())
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()
    })
}

pub(super) fn wait_listen_addr(
    dir: &Path,
    netns: Option<&str>,
    child: &mut Child,
) -> Result<String> {
    let deadline = Instant::now() + START_WAIT;
    loop {
        if let Some(a) =
            status(dir, netns).and_then(|s| s["listen_addrs"][0].as_str().map(str::to_owned))
        {
            return Ok(a);
        }
        check_starting(child, &dir.join("node.log"), deadline)?;
        check_interrupted()?;
        std::thread::sleep(Duration::from_millis(100));
    }
}
