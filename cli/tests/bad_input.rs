//! Bad input at the command line: each case must end with one line on stderr naming the cause,
//! a non-zero exit code, and nothing written (the data directory is never created).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_p2ptrain");

fn default_config() -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/digits-mlp.toml"),
    )
    .expect("config")
}

/// Runs `p2ptrain` with a 120 s limit; returns (success, stderr).
fn run(args: &[&str]) -> (bool, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("p2ptrain {args:?} hung");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts a failed `join` with a one-line error containing every `needle`, and no data dir.
fn join_fails(extra: &[&str], needles: &[&str]) {
    let tmp = tempfile::tempdir().expect("tmp");
    let data: PathBuf = tmp.path().join("node");
    let mut args = vec!["join", "--data-dir", data.to_str().expect("utf8")];
    if !extra.contains(&"--api") {
        args.extend(["--api", "127.0.0.1:0"]);
    }
    args.extend_from_slice(extra);
    let (ok, err) = run(&args);
    assert!(!ok, "join {extra:?} should fail");
    let lines: Vec<&str> = err.trim().lines().collect();
    assert_eq!(lines.len(), 1, "one line expected, got:\n{err}");
    for n in needles {
        assert!(lines[0].contains(n), "{:?} lacks {n:?}", lines[0]);
    }
    assert!(!data.exists(), "a failed join wrote {}", data.display());
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p.to_str().expect("utf8").to_string()
}

#[test]
fn unknown_config_key() {
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = write(
        tmp.path(),
        "c.toml",
        &default_config().replace("[train]", "[train]\nbatchsize = 3"),
    );
    join_fails(
        &["--config", &cfg],
        &["c.toml", "batchsize", "unknown field"],
    );
}

#[test]
fn widths_that_do_not_fit_the_data() {
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = write(
        tmp.path(),
        "c.toml",
        &default_config().replace("[64, 128, 10]", "[784, 128, 10]"),
    );
    join_fails(&["--config", &cfg], &["model.widths", "64 features"]);
}

#[test]
fn missing_data_file() {
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = write(
        tmp.path(),
        "c.toml",
        &default_config().replace(
            "source = \"digits\"",
            "source = \"digits\"\npath = \"no-such-digits.csv.gz\"",
        ),
    );
    join_fails(
        &["--config", &cfg],
        &["no-such-digits.csv.gz", "No such file"],
    );
}

#[test]
fn non_numeric_csv() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut row = vec!["0"; 64];
    row[10] = "seven";
    write(tmp.path(), "bad.csv", &format!("{},3\n", row.join(",")));
    let cfg = write(
        tmp.path(),
        "c.toml",
        &default_config().replace(
            "source = \"digits\"",
            "source = \"digits\"\npath = \"bad.csv\"",
        ),
    );
    join_fails(
        &["--config", &cfg],
        &["bad.csv", "line 1", "\"seven\" is not a number"],
    );
}

#[test]
fn wrong_idx_magic() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mnist = tmp.path().join("mnist");
    std::fs::create_dir(&mnist).expect("mkdir");
    // Label-file magic where an image file belongs.
    let mut bogus = vec![0u8, 0, 8, 1, 0, 0, 0, 1];
    bogus.push(3);
    for name in [
        "train-images.idx3-ubyte",
        "train-labels.idx1-ubyte",
        "t10k-images.idx3-ubyte",
        "t10k-labels.idx1-ubyte",
    ] {
        std::fs::write(mnist.join(name), &bogus).expect("write");
    }
    let cfg_text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/mnist-mlp.toml"),
    )
    .expect("config")
    .replace("../../shared/data/mnist", "mnist");
    let cfg = write(tmp.path(), "c.toml", &cfg_text);
    join_fails(
        &["--config", &cfg],
        &["train-images.idx3-ubyte", "wrong IDX magic"],
    );
}

#[test]
fn cuda_without_the_feature() {
    join_fails(
        &["--device", "cuda"],
        &["without CUDA support", "--features cuda"],
    );
}

#[test]
fn unknown_device_name() {
    join_fails(
        &["--device", "tpu"],
        &["--device", "unknown device \"tpu\""],
    );
}

#[test]
fn busy_api_port() {
    let busy = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = busy.local_addr().expect("addr").to_string();
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("node");
    let (ok, err) = run(&[
        "join",
        "--data-dir",
        data.to_str().expect("utf8"),
        "--api",
        &addr,
    ]);
    assert!(!ok);
    let lines: Vec<&str> = err.trim().lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains(&addr) && lines[0].contains("in use"),
        "{}",
        lines[0]
    );
    assert!(!data.exists());
}

#[test]
fn status_with_no_daemon() {
    // A port that was just free: nothing listens there.
    let port = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let (ok, err) = run(&["status", "--api", &addr]);
    assert!(!ok);
    let lines: Vec<&str> = err.trim().lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains("cannot reach a p2ptrain daemon") && lines[0].contains(&addr),
        "{}",
        lines[0]
    );
}

#[test]
fn api_token_that_no_header_can_carry() {
    join_fails(&["--api-token", "two words"], &["--api-token", "printable"]);
}

#[test]
fn eval_of_a_corrupt_checkpoint() {
    let tmp = tempfile::tempdir().expect("tmp");
    let f = write(tmp.path(), "x.safetensors", "definitely not a checkpoint");
    let (ok, err) = run(&["eval", "--checkpoint", &f]);
    assert!(!ok);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("x.safetensors") && err.contains("not a readable safetensors file"),
        "{err}"
    );
}

#[test]
fn bad_bootstrap_address_is_refused_before_anything_is_written() {
    join_fails(
        &["--bootstrap", "not-a-multiaddr"],
        &["--bootstrap", "\"not-a-multiaddr\" is not a multiaddr"],
    );
}
