//! The PyTorch DDP opponent: the Python environment `bench/setup_torch.sh` made, and one
//! `bench/ddp_train.py` process per rank.

use super::*;

/// The kind of the PyTorch DDP runs.
pub(super) const TORCH_KIND: &str = "pytorch_ddp";

/// One DDP rank, relative to the repository's root (where the benchmark runs).
pub(super) const DDP_SCRIPT: &str = "bench/ddp_train.py";

/// DDP's rendezvous port on the first lab host: the lab's own namespace, where only the
/// benchmark's DDP runs listen, one after another.
pub(super) const DDP_MASTER_PORT: u16 = 29517;

/// Writes the config's data, as p2ptrain loads it, where `bench/ddp_train.py` reads it
/// (`meta.json` and raw little-endian arrays), and returns what every DDP run shares.
pub(super) fn torch_side(config_path: &Path, dir: &Path) -> Result<TorchSide> {
    let config = Config::load(Some(config_path))?;
    // Refused before its data is read (a llama's text is tokenized whole as it loads).
    if matches!(
        config.model,
        p2ptrain_daemon::config::ModelConfig::Llama { .. }
    ) {
        bail!("the DDP comparison has a gpt, an mlp and a cnn, not a llama: pass --no-torch");
    }
    let data = config.load_data()?;
    let spec = config.model_spec(&data)?;
    std::fs::create_dir_all(dir)?;
    let meta = match &data {
        Data::Text(t) => {
            std::fs::write(dir.join("train.bytes"), t.train.bytes())?;
            std::fs::write(dir.join("test.bytes"), t.test.bytes())?;
            let context = match &config.model {
                p2ptrain_daemon::config::ModelConfig::Gpt(g) => g.context,
                _ => bail!("a text data set needs a gpt model"),
            };
            serde_json::json!({
                "kind": "text",
                "context": context,
                "train_stride": (context / p2ptrain_models::text::TRAIN_STRIDE_DIVISOR).max(1),
            })
        }
        Data::Tokens(_) => bail!("the DDP comparison reads no token data: pass --no-torch"),
        Data::Labeled(split) => {
            for (half, set) in [("train", &split.train), ("test", &split.test)] {
                let x: Vec<u8> = set.features.iter().flat_map(|v| v.to_le_bytes()).collect();
                let y: Vec<u8> = set.labels.iter().flat_map(|v| v.to_le_bytes()).collect();
                std::fs::write(dir.join(format!("{half}_x.f32")), x)?;
                std::fs::write(dir.join(format!("{half}_y.u32")), y)?;
            }
            serde_json::json!({
                "kind": "labeled",
                "dim": split.train.dim,
                "classes": split.train.classes,
            })
        }
    };
    std::fs::write(dir.join("meta.json"), meta.to_string())?;
    Ok(TorchSide {
        data: dir.to_path_buf(),
        spec: serde_json::to_string(&spec)?,
        optimizer: serde_json::to_value(&config.optimizer)?,
        schedule: serde_json::to_string(&config.schedule)?,
        init_seed: config.train.init_seed,
    })
}

/// What every DDP run shares: the exported data and the config's model, optimizer and
/// schedule as `bench/ddp_train.py` reads them.
pub(super) struct TorchSide {
    pub(super) data: PathBuf,
    pub(super) spec: String,
    pub(super) optimizer: serde_json::Value,
    pub(super) schedule: String,
    pub(super) init_seed: u64,
}

/// Starts DDP's rank `k` of `plan`, its output in `dir/node.log`.
pub(super) fn spawn_rank(
    bench: &Bench,
    plan: &Plan,
    k: usize,
    dir: &Path,
    master: &str,
) -> Result<Child> {
    let torch = bench.torch.as_ref().context("no DDP side")?;
    let args = bench.args;
    std::fs::create_dir_all(dir)?;
    let log = std::fs::File::create(dir.join("node.log"))?;
    let mut optimizer = torch.optimizer.clone();
    optimizer["lr"] = plan.lr.into();
    let mut cmd = bench.pinned(&plan.arm, k, &args.python);
    cmd.arg(DDP_SCRIPT)
        .args(["--rank", &k.to_string(), "--nodes", &plan.nodes.to_string()])
        .args(["--master", master])
        .arg("--data")
        .arg(&torch.data)
        .args(["--spec", &torch.spec, "--schedule", &torch.schedule])
        .args(["--optim", &optimizer.to_string()])
        .args(["--batch", &plan.batch_size.to_string()])
        .args(["--init-seed", &torch.init_seed.to_string()])
        .args(["--seed", &(plan.seed * 100 + k as u64).to_string()])
        .args(["--threads", &args.cores_per_node.to_string()])
        .args(["--eval-every", &args.eval_every.to_string()])
        .args(["--max-seconds", &(args.timeout + 60.0).to_string()])
        .arg("--dir")
        .arg(dir);
    if bench.lab_ns(&plan.arm, k).is_some() {
        cmd.args(["--iface", "eth0"]);
    }
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    cmd.spawn()
        .with_context(|| format!("cannot run {} under taskset", args.python.display()))
}

/// A TCP port free on loopback now, for DDP's rendezvous.
pub(super) fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
