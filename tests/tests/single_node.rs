//! A single node: training to accuracy, status, checkpoints, crash and resume.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::harness::{
    cli, eval_json, mnist_dir, newest_checkpoint, read_checkpoint, repo_root, Node,
};

/// The default config with the checkpoint policy replaced, written to `dir`.
fn digits_config(dir: &Path, every_steps: u64, keep: usize) -> PathBuf {
    let text =
        std::fs::read_to_string(repo_root().join("configs/digits-mlp.toml")).expect("config");
    let text = text
        .replace(
            "every_steps = 5000",
            &format!("every_steps = {every_steps}"),
        )
        .replace("every_secs = 30", "every_secs = 0")
        .replace("keep = 5", &format!("keep = {keep}"));
    let path = dir.join("digits.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

#[test]
fn default_run_on_digits_reaches_95_percent() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("node");
    // The built-in default config, bounded in steps for the test.
    let mut node = Node::start(&data, &["--max-steps", "3000"]);
    node.wait_api();
    let status = node.wait_exit(Duration::from_secs(300));
    assert!(status.success(), "node failed: {}", node.log_text());
    let final_ck = newest_checkpoint(&data).expect("final checkpoint");
    let eval = eval_json(&final_ck, None);
    let acc = eval["accuracy"].as_f64().expect("accuracy");
    assert_eq!(eval["step"], 3000);
    assert!(acc >= 0.95, "held-out accuracy {acc} < 0.95");
}

/// `--log-format json` writes every log line as one JSON object (a collector reads them whole);
/// `-q` keeps only warnings and errors.
#[test]
fn log_lines_come_as_json_objects_or_quietly_as_asked() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Run directly rather than through `Node`, which sets `RUST_LOG` (that would decide).
    let run = |name: &str, flags: &[&str]| {
        let dir = tmp.path().join(name);
        let dir = dir.to_str().expect("utf8");
        let mut args = vec![
            "join",
            "--data-dir",
            dir,
            "--api",
            "127.0.0.1:0",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--max-steps",
            "200",
        ];
        args.extend_from_slice(flags);
        let log = tmp.path().join(format!("{name}.log"));
        /// Kills the node if the test gives up on it.
        struct KillOnDrop(std::process::Child);
        impl Drop for KillOnDrop {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let mut child = std::process::Command::new(crate::harness::bin())
            .args(&args)
            .env_remove("RUST_LOG")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .map(KillOnDrop)
            .expect("run p2ptrain join");
        let exited =
            crate::harness::eventually(Duration::from_secs(120), "the node's exit", || {
                child.0.try_wait().expect("wait")
            });
        let text = std::fs::read_to_string(&log).expect("log");
        assert!(exited.success(), "{text}");
        text
    };
    let json = run("json", &["--log-format", "json"]);
    let objects: Vec<serde_json::Value> = json
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(
        objects
            .iter()
            .any(|o| o["level"] == "INFO" && o["fields"]["message"].is_string()),
        "{json}"
    );
    assert!(
        json.lines()
            .all(|l| l.starts_with('{') || !l.contains(" INFO ")),
        "a text log line: {json}"
    );
    let quiet = run("quiet", &["-q"]);
    assert!(!quiet.contains(" INFO "), "{quiet}");
    let text = run("text", &[]);
    assert!(text.contains(" INFO "), "{text}");
}

#[test]
fn mnist_mlp_reaches_97_percent_in_two_epochs() {
    let Some(mnist) = mnist_dir() else {
        crate::harness::skip_or_fail(
            "MNIST",
            "MNIST IDX files not found beside the checkout (../shared/data/mnist) or in P2PTRAIN_MNIST_DIR",
        );
        return;
    };
    let tmp = tempfile::tempdir().expect("tmp");
    let text = std::fs::read_to_string(repo_root().join("configs/mnist-mlp.toml")).expect("config");
    // A fixed data order: over eight node seeds this config ended at 96.6-97.5% (most above
    // 97%), so a random order would make the test flaky; seed 1 is one of the typical ones.
    let text = text
        .replace(
            "dir = \"../../shared/data/mnist\"",
            &format!("dir = {:?}", mnist.display().to_string()),
        )
        .replace("init_seed = 42", "init_seed = 42\nnode_seed = 1");
    let config = tmp.path().join("mnist.toml");
    std::fs::write(&config, &text).expect("config");
    // Two epochs of 60,000 samples at the config's batch of 32.
    assert!(text.contains("batch_size = 32"));
    let steps = (2 * 60_000 / 32).to_string();
    let mut node = Node::start(
        &tmp.path().join("node"),
        &[
            "--config",
            config.to_str().expect("utf8"),
            "--max-steps",
            &steps,
        ],
    );
    node.wait_api();
    let status = node.wait_exit(Duration::from_secs(600));
    assert!(status.success(), "node failed: {}", node.log_text());
    let final_ck = newest_checkpoint(&tmp.path().join("node")).expect("final checkpoint");
    let eval = eval_json(&final_ck, Some(&config));
    let acc = eval["accuracy"].as_f64().expect("accuracy");
    assert_eq!(eval["samples"], 10_000);
    assert!(
        acc >= 0.97,
        "MNIST held-out accuracy {acc} < 0.97 after two epochs"
    );
}

#[test]
fn kill9_then_restart_resumes_with_the_same_optimizer_state() {
    let tmp = tempfile::tempdir().expect("tmp");
    let config = digits_config(tmp.path(), 200, 3);
    let cfg = config.to_str().expect("utf8");
    let data = tmp.path().join("node");
    let mut node = Node::start(&data, &["--config", cfg]);
    node.wait_api();
    node.wait_status(
        "a checkpoint at step >= 600",
        Duration::from_secs(120),
        |s| {
            s["last_checkpoint"]["step"]
                .as_u64()
                .is_some_and(|st| st >= 600)
        },
    );
    node.kill9();

    let newest = newest_checkpoint(&data).expect("a checkpoint survived the crash");
    let (meta, before) = read_checkpoint(&newest);
    let step: u64 = meta["step"].parse().expect("step");
    assert!(
        before.keys().any(|k| k.starts_with("optim.momentum.")),
        "optimizer state is in the checkpoint"
    );

    // Restart with max_steps equal to the checkpoint's step: the node loads the state and
    // immediately writes it back out. Bit-identical tensors prove parameters and optimizer
    // state both survived the crash and the reload.
    let mut same = Node::start(&data, &["--config", cfg, "--max-steps", &step.to_string()]);
    assert!(
        same.wait_exit(Duration::from_secs(120)).success(),
        "{}",
        same.log_text()
    );
    let log = same.log_text();
    assert!(log.contains("resumed from checkpoint"), "{log}");
    // The comparison below proves something only if the file was written anew.
    let rewritten = newest_checkpoint(&data).expect("final");
    assert_ne!(
        rewritten, newest,
        "the restart wrote no checkpoint of its own"
    );
    let (meta2, after) = read_checkpoint(&rewritten);
    let id = |m: &std::collections::HashMap<String, String>| -> u64 {
        m["id"].parse().expect("checkpoint id")
    };
    assert!(
        id(&meta2) > id(&meta),
        "checkpoint {} is not newer than {}",
        id(&meta2),
        id(&meta)
    );
    assert_eq!(meta2["step"], meta["step"]);
    assert_eq!(meta2["optimizer_steps"], meta["optimizer_steps"]);
    assert_eq!(
        after, before,
        "parameters and optimizer state after resume differ from the checkpoint"
    );

    // And a normal restart keeps training from there.
    let mut resumed = Node::start(&data, &["--config", cfg]);
    resumed.wait_api();
    let s = resumed.wait_status(
        "training past the checkpoint",
        Duration::from_secs(60),
        |s| s["step"].as_u64().is_some_and(|st| st > step),
    );
    assert_eq!(s["resumed_from"]["step"].as_u64(), Some(step));
}

#[test]
fn truncated_newest_checkpoint_is_skipped_and_the_previous_loaded() {
    let tmp = tempfile::tempdir().expect("tmp");
    let config = digits_config(tmp.path(), 250, 5);
    let cfg = config.to_str().expect("utf8");
    let data = tmp.path().join("node");
    let mut node = Node::start(&data, &["--config", cfg, "--max-steps", "1000"]);
    node.wait_api();
    assert!(
        node.wait_exit(Duration::from_secs(120)).success(),
        "{}",
        node.log_text()
    );

    let newest = newest_checkpoint(&data).expect("checkpoint");
    let (newest_meta, _) = read_checkpoint(&newest);
    let len = std::fs::metadata(&newest).expect("meta").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&newest)
        .and_then(|f| f.set_len(len / 2))
        .expect("truncate");
    let newest_id: u64 = newest_meta["id"].parse().expect("id");

    let mut restarted = Node::start(&data, &["--config", cfg]);
    restarted.wait_api();
    let s = restarted.wait_status("the resumed node", Duration::from_secs(60), |s| {
        s["resumed_from"].is_object()
    });
    let resumed_id = s["resumed_from"]["id"].as_u64().expect("id");
    assert!(
        resumed_id < newest_id,
        "resumed from {resumed_id}, the truncated one was {newest_id}"
    );
    let log = restarted.log_text();
    let report: Vec<&str> = log.lines().filter(|l| l.contains("corrupt")).collect();
    assert_eq!(
        report.len(),
        1,
        "exactly one clear line about the bad file:\n{log}"
    );
    assert!(
        report[0].contains(&format!("checkpoint {newest_id}")) && report[0].contains("skipped"),
        "{}",
        report[0]
    );
}

#[test]
fn status_checkpoints_export_and_restore_over_the_api() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Automatic checkpoints too, so that the restore goes back behind one of them; kept
    // long enough that the saved one is still there.
    let config = digits_config(tmp.path(), 2000, 1000);
    let data = tmp.path().join("node");
    let mut node = Node::start(&data, &["--config", config.to_str().expect("utf8")]);
    let api = node.wait_api();
    let s = node.wait_status("some training", Duration::from_secs(60), |s| {
        s["step"].as_u64().is_some_and(|v| v > 100)
    });
    for key in [
        "peer_id",
        "run_id",
        "device",
        "step",
        "samples_seen",
        "loss",
        "samples_per_sec",
        "uptime_s",
        "data_dir",
    ] {
        assert!(!s[key].is_null(), "status lacks {key}: {s}");
    }
    assert_eq!(s["model"]["name"], "mlp-64-128-10");
    assert_eq!(s["model"]["params"], 64 * 128 + 128 + 128 * 10 + 10);
    assert_eq!(s["device"], "cpu");

    let (st, out, err) = cli(
        &["checkpoint", "save", "--json", "--api", &api],
        Duration::from_secs(30),
    );
    assert!(st.success(), "{err}");
    let saved: serde_json::Value = serde_json::from_str(&out).expect("json");
    let saved_step = saved["step"].as_u64().expect("step");
    assert!(Path::new(saved["path"].as_str().expect("path")).exists());

    let (st, out, _) = cli(
        &["checkpoint", "list", "--json", "--api", &api],
        Duration::from_secs(30),
    );
    assert!(st.success());
    let list: Vec<serde_json::Value> = serde_json::from_str(&out).expect("json");
    assert!(list.iter().any(|c| c["id"] == saved["id"]));

    // Export: a standard safetensors file with the documented names and shapes.
    let out_file = tmp.path().join("export.safetensors");
    let (st, _, err) = cli(
        &[
            "checkpoint",
            "export",
            "--out",
            out_file.to_str().expect("utf8"),
            "--api",
            &api,
        ],
        Duration::from_secs(30),
    );
    assert!(st.success(), "{err}");
    let (meta, tensors) = read_checkpoint(&out_file);
    assert_eq!(meta["format"], "p2ptrain-checkpoint/1");
    assert_eq!(meta["run_id"], s["run_id"].as_str().expect("run id"));
    for key in [
        "step",
        "samples_seen",
        "optimizer_steps",
        "checksum",
        "layout_hash",
        "config_hash",
        "model",
    ] {
        assert!(meta.contains_key(key), "metadata lacks {key}");
    }
    let expect = [
        ("fc0.weight", vec![128, 64]),
        ("fc0.bias", vec![128]),
        ("fc1.weight", vec![10, 128]),
        ("fc1.bias", vec![10]),
    ];
    for (name, shape) in &expect {
        assert_eq!(&tensors[*name].0, shape, "{name}");
        assert_eq!(
            &tensors[&format!("optim.momentum.{name}")].0,
            shape,
            "momentum of {name}"
        );
    }
    assert_eq!(tensors.len(), 8, "{:?}", tensors.keys().collect::<Vec<_>>());
    assert!(tensors
        .values()
        .all(|(_, v)| v.iter().all(|x| x.is_finite())));

    // Restore the earlier checkpoint: the step goes back to it, behind an automatic
    // checkpoint written since, then training goes on. A second of training first makes the
    // way back much longer than the few steps the node takes between the restore and the next
    // status request.
    std::thread::sleep(Duration::from_secs(1));
    let s = node.wait_status(
        "an automatic checkpoint after the saved one",
        Duration::from_secs(60),
        |s| s["last_checkpoint"]["step"].as_u64() > Some(saved_step),
    );
    let before = s["step"].as_u64().expect("step");
    let id = saved["id"].as_u64().expect("id").to_string();
    let (st, out, err) = cli(
        &["checkpoint", "restore", &id, "--json", "--api", &api],
        Duration::from_secs(30),
    );
    assert!(st.success(), "{err}");
    let restored: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(restored["step"].as_u64(), Some(saved_step));
    let after = node.status().expect("status")["step"]
        .as_u64()
        .expect("step");
    assert!(
        after < before,
        "step went from {before} to {after} after restoring step {saved_step}"
    );
    node.wait_status(
        "training on from the restored step, past the next checkpoint",
        Duration::from_secs(60),
        |s| s["step"].as_u64() > Some(before + 2000),
    );

    let (st, _, err) = cli(&["stop", "--api", &api], Duration::from_secs(30));
    assert!(st.success(), "{err}");
    assert!(node.wait_exit(Duration::from_secs(60)).success());
    assert!(
        !data.join("api.addr").exists(),
        "a stopped node leaves no address file"
    );
}

/// One raw HTTP/1.0 request to `api` with the given extra header lines; answers the status
/// code.
fn raw_request(api: &str, method: &str, path: &str, headers: &[String]) -> u16 {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(api).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut req = format!("{method} {path} HTTP/1.0\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str("\r\n");
    conn.write_all(req.as_bytes()).expect("write");
    let mut reply = String::new();
    let _ = conn.read_to_string(&mut reply);
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {reply:?}"))
}

/// The control API asks for the token the node made at its first start, on loopback too: a
/// request without it, with a wrong one, naming a foreign Host (DNS rebinding) or coming
/// from a foreign web page (Origin) is refused, and a refused `stop` stops nothing. The CLI
/// finds the token by itself (nobody types it), and a wrong one given is refused with one
/// `error:` line.
#[test]
fn the_api_refuses_requests_without_the_token_or_from_a_foreign_host_or_origin() {
    let tmp = tempfile::tempdir().expect("tmp");
    let config = digits_config(tmp.path(), 0, 5);
    let data = tmp.path().join("node");
    let mut node = Node::start(&data, &["--config", config.to_str().expect("utf8")]);
    let api = node.wait_api();
    let token = node.api_token().expect("a token in the data directory");
    assert_eq!(token.len(), 64, "{token}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(data.join("api.token"))
            .expect("token file")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the token file is the user's alone");
    }
    let host = format!("Host: {api}");
    let auth = format!("Authorization: Bearer {token}");
    let status =
        |method: &str, path: &str, headers: &[String]| raw_request(&api, method, path, headers);
    assert_eq!(
        status("GET", "/v1/status", &[host.clone(), auth.clone()]),
        200
    );
    assert_eq!(
        status("GET", "/v1/status", std::slice::from_ref(&host)),
        401
    );
    assert_eq!(status("GET", "/metrics", std::slice::from_ref(&host)), 401);
    let wrong = format!("Authorization: Bearer {}x", &token[..63]);
    assert_eq!(status("GET", "/v1/status", &[host.clone(), wrong]), 401);
    let rebound = "Host: attacker.example:80".to_string();
    assert_eq!(status("GET", "/v1/status", &[rebound, auth.clone()]), 403);
    let foreign = "Origin: http://attacker.example".to_string();
    assert_eq!(
        status("POST", "/v1/stop", &[host.clone(), auth.clone(), foreign]),
        403
    );
    assert_eq!(status("POST", "/v1/stop", std::slice::from_ref(&host)), 401);
    let own = format!("Origin: http://{api}");
    assert_eq!(
        status("GET", "/v1/status", &[host.clone(), auth.clone(), own]),
        200
    );
    // Nothing refused stopped the node.
    node.wait_status("still training", Duration::from_secs(30), |s| {
        s["phase"] == "training"
    });
    // The CLI without a token, then with a wrong one.
    let (st, out, err) = cli(
        &["status", "--json", "--api", &api],
        Duration::from_secs(30),
    );
    assert!(st.success(), "the CLI found no token: {err}");
    assert!(out.contains("peer_id"), "{out}");
    let (st, _, err) = cli(
        &["status", "--api", &api, "--api-token", "wrong"],
        Duration::from_secs(30),
    );
    assert!(!st.success());
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(errors[0].contains("401"), "{err}");
    let (st, _, err) = cli(&["stop", "--api", &api], Duration::from_secs(30));
    assert!(st.success(), "{err}");
    assert!(node.wait_exit(Duration::from_secs(60)).success());
}
