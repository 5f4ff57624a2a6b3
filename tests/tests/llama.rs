//! The Llama-family decoder as a user runs it: `p2ptrain tokenize` writes the ids the Python
//! tokenizer gives; a node trains the tiny Llama on a token file of Hamlet and brings its
//! held-out bits per byte down and `sample` continues a prompt; `p2ptrain export` writes its checkpoint as a Hugging Face
//! folder that reads back to the checkpoint's parameters; two nodes train one together.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::harness::{
    cli, edited_config, eval_json, newest_checkpoint, read_checkpoint, repo_root, Node,
};
use crate::mesh::{listen_addr, peers, start};

/// Steps a lone node trains in the test.
const STEPS: u64 = 300;

fn fixture() -> PathBuf {
    repo_root().join("models/fixtures/hf-llama-tiny")
}

fn tokenizer() -> String {
    fixture()
        .join("tokenizer.json")
        .to_str()
        .expect("utf8")
        .to_string()
}

/// `p2ptrain tokenize` of `texts` into `out`; asserts it succeeded.
fn tokenize(out: &Path, texts: &[&Path]) -> String {
    let mut args = vec![
        "tokenize".to_string(),
        "--tokenizer".into(),
        tokenizer(),
        "--out".into(),
        out.to_str().expect("utf8").into(),
    ];
    args.extend(texts.iter().map(|t| t.to_str().expect("utf8").to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (st, stdout, err) = cli(&args, Duration::from_secs(120));
    assert!(st.success(), "{err}");
    stdout
}

/// `configs/llama-tiny.toml` reading the token file `tokens` (and its tokenizer for bits per
/// byte), evaluating every 50 steps, its schedule over `steps`, plus `extra` TOML.
fn llama_config(dir: &Path, name: &str, tokens: &Path, steps: u64, extra: &str) -> PathBuf {
    let source = format!(
        "source = \"tokens\"\npath = \"{}\"",
        tokens.to_str().expect("utf8")
    );
    let tokenizer = format!("tokenizer = \"{}\"", tokenizer());
    let total = format!("total_steps = {steps}");
    edited_config(
        dir,
        name,
        "configs/llama-tiny.toml",
        &[
            (
                "source = \"text\"       # no path: the bundled Hamlet (174 KB), tokenized at start-up",
                &source,
            ),
            (
                "tokenizer = \"../models/fixtures/hf-llama-tiny/tokenizer.json\"",
                &tokenizer,
            ),
            ("total_steps = 5000", &total),
            ("eval_every = 0", "eval_every = 50"),
            ("eval_every_secs = 10", "eval_every_secs = 0"),
            ("every_secs = 60", "every_secs = 0"),
        ],
        extra,
    )
}

#[test]
fn tokenize_writes_the_python_tokenizers_ids() {
    let tmp = tempfile::tempdir().expect("tmp");
    let expected: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture().join("expected.json")).expect("expected"),
    )
    .expect("json");
    let check = &expected["tokenizer_check"];
    let text = tmp.path().join("text.txt");
    std::fs::write(&text, check["text"].as_str().expect("text")).expect("write");
    let out = tmp.path().join("text.bin");
    tokenize(&out, &[&text]);
    let ids: Vec<u64> = std::fs::read(&out)
        .expect("token file")
        .chunks_exact(2)
        .map(|b| u64::from(u16::from_le_bytes([b[0], b[1]])))
        .collect();
    let want: Vec<u64> = check["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_u64().expect("id"))
        .collect();
    assert_eq!(ids, want);
    // An existing file is never overwritten; a missing tokenizer is one error line.
    let (st, _, err) = cli(
        &[
            "tokenize",
            "--tokenizer",
            &tokenizer(),
            "--out",
            out.to_str().expect("utf8"),
            text.to_str().expect("utf8"),
        ],
        Duration::from_secs(60),
    );
    assert!(!st.success() && err.contains("never overwritten"), "{err}");
    let (st, _, err) = cli(
        &[
            "tokenize",
            "--tokenizer",
            "/nonexistent/tokenizer.json",
            "--out",
            tmp.path().join("x.bin").to_str().expect("utf8"),
            text.to_str().expect("utf8"),
        ],
        Duration::from_secs(60),
    );
    assert!(!st.success(), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!tmp.path().join("x.bin").exists());
    // A text that is not UTF-8 after a good one fails the run once ids are being written: no
    // token file of a cut corpus, and the partial file removed.
    let not_text = tmp.path().join("not-text.bin");
    std::fs::write(&not_text, [0x66u8, 0x6f, 0xff, 0xfe, 0x6f]).expect("write");
    let (st, _, err) = cli(
        &[
            "tokenize",
            "--tokenizer",
            &tokenizer(),
            "--out",
            tmp.path().join("y.bin").to_str().expect("utf8"),
            text.to_str().expect("utf8"),
            not_text.to_str().expect("utf8"),
        ],
        Duration::from_secs(60),
    );
    assert!(!st.success() && err.contains("not UTF-8"), "{err}");
    assert!(
        !tmp.path().join("y.bin").exists(),
        "a token file of a cut corpus"
    );
    assert!(
        !tmp.path().join("y.partial").exists(),
        "the partial file was left"
    );
}

#[test]
fn a_llama_learns_hamlets_tokens_and_exports_to_a_hugging_face_folder() {
    let _cores = crate::harness::cpu_hog();
    let tmp = tempfile::tempdir().expect("tmp");
    let tokens = tmp.path().join("hamlet.bin");
    let said = tokenize(&tokens, &[&repo_root().join("data/hamlet.txt.gz")]);
    eprintln!("{said}");
    let cfg = llama_config(tmp.path(), "llama.toml", &tokens, STEPS, "");
    let cfg_arg = cfg.to_str().expect("utf8");
    let data = tmp.path().join("node");
    let started = std::time::Instant::now();
    let mut node = Node::start(
        &data,
        &["--config", cfg_arg, "--max-steps", &STEPS.to_string()],
    );
    node.wait_api();
    let first = node.wait_status("a first evaluation", Duration::from_secs(120), |s| {
        s["eval"]["bits_per_byte"].is_number()
    });
    assert!(
        node.wait_exit(Duration::from_secs(600)).success(),
        "{}",
        node.log_text()
    );
    let secs = started.elapsed().as_secs_f64();
    let ck = newest_checkpoint(&data).expect("final checkpoint");
    let e = eval_json(&ck, Some(&cfg));
    let (before, after) = (
        first["eval"]["bits_per_byte"].as_f64().expect("bpb"),
        e["bits_per_byte"].as_f64().expect("bpb"),
    );
    eprintln!(
        "llama alone: {before:.3} bits per byte at step {}, {after:.3} after {STEPS} steps ({secs:.1} s); {e}",
        first["eval"]["step"]
    );
    assert_eq!(e["step"], STEPS);
    assert_eq!(
        e["model"],
        "llama-v384-c64-l2-w64-i128-h4-k2-d16-e0.00001-r10000"
    );
    // Per token and per byte: the loss in nats per token over the bytes a token stands for
    // (two and a bit, with this tokenizer) reads as fewer bits per byte than per token.
    let per_token_bits = e["loss"].as_f64().expect("loss") / std::f64::consts::LN_2;
    assert!(after < per_token_bits / 1.5, "{after} {per_token_bits}");
    assert!(after < before - 0.5, "{before} -> {after}");

    // `sample` continues a prompt through the tokenizer, the same text for the same seed.
    let sample = || {
        let (st, out, err) = cli(
            &[
                "sample",
                "--checkpoint",
                ck.to_str().expect("utf8"),
                "--tokenizer",
                &tokenizer(),
                "--prompt",
                "HAMLET.",
                "--bytes",
                "40",
            ],
            Duration::from_secs(60),
        );
        assert!(st.success(), "{err}");
        out
    };
    let text = sample();
    eprintln!("sample:\n{text}");
    assert!(
        text.starts_with("HAMLET.") && text.len() > "HAMLET.".len() + 40,
        "{text}"
    );
    assert_eq!(sample(), text);

    // The checkpoint as a Hugging Face folder, which reads back to its parameters.
    let out = tmp.path().join("hf");
    let (st, _, err) = cli(
        &[
            "export",
            "--checkpoint",
            ck.to_str().expect("utf8"),
            "--out",
            out.to_str().expect("utf8"),
            "--tokenizer",
            &tokenizer(),
        ],
        Duration::from_secs(60),
    );
    assert!(st.success(), "{err}");
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(out.join(file).is_file(), "{file}");
    }
    let folder = p2ptrain_models::hf::read_folder(&out).expect("the export reads back");
    let (_, tensors) = read_checkpoint(&ck);
    assert_eq!(folder.tensors.len(), folder.spec.parameter_shapes().len());
    for (name, t) in &folder.tensors {
        let (shape, values) = tensors.get(name).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(t.dims(), shape.as_slice(), "{name}");
        let got = t.flatten_all().expect("f").to_vec1::<f32>().expect("v");
        assert_eq!(&got, values, "{name}");
    }
    // Never over an existing folder's files.
    let (st, _, err) = cli(
        &[
            "export",
            "--checkpoint",
            ck.to_str().expect("utf8"),
            "--out",
            out.to_str().expect("utf8"),
        ],
        Duration::from_secs(60),
    );
    assert!(!st.success() && err.contains("not empty"), "{err}");
}

#[test]
fn two_llama_nodes_share_their_training() {
    let _cores = crate::harness::cpu_hog();
    let tmp = tempfile::tempdir().expect("tmp");
    let tokens = tmp.path().join("hamlet.bin");
    tokenize(&tokens, &[&repo_root().join("data/hamlet.txt.gz")]);
    let steps = 300;
    let cfg = llama_config(tmp.path(), "llama.toml", &tokens, steps, "");
    let max = steps.to_string();
    let mut a = start(
        tmp.path(),
        "a",
        &cfg,
        None,
        &["--max-steps", &max, "--shard", "0/2"],
    );
    let addr = listen_addr(&a);
    let mut b = start(
        tmp.path(),
        "b",
        &cfg,
        Some(&addr),
        &["--max-steps", &max, "--shard", "1/2"],
    );
    for n in [&a, &b] {
        n.wait_status("a peer", Duration::from_secs(60), |s| peers(s) >= 1);
    }
    for n in [&a, &b] {
        let s = n.wait_status("updates from the other", Duration::from_secs(120), |s| {
            s["updates"]["applied"].as_u64().unwrap_or(0) >= 5
        });
        eprintln!("updates {} at step {}", s["updates"], s["step"]);
        assert_eq!(s["updates"]["rejected"].as_u64(), Some(0), "{s}");
    }
    for n in [&mut a, &mut b] {
        assert!(
            n.wait_exit(Duration::from_secs(600)).success(),
            "{}",
            n.log_text()
        );
    }
}

#[test]
fn a_llama_starts_from_a_hugging_face_folders_weights() {
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = tmp.path().join("hf.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\nkind = \"llama\"\nhf = \"{}\"\ncontext = 64\n\
             [optimizer]\nkind = \"adamw\"\nlr = 0.0001\n\
             [data]\nsource = \"text\"\ntokenizer = \"{}\"\ntest_fraction = 0.1\n\
             [train]\nbatch_size = 8\nthreads = 1\n",
            fixture().to_str().expect("utf8"),
            tokenizer()
        ),
    )
    .expect("config");
    let data = tmp.path().join("node");
    let mut node = Node::start(
        &data,
        &["--config", cfg.to_str().expect("utf8"), "--max-steps", "1"],
    );
    assert!(
        node.wait_exit(Duration::from_secs(120)).success(),
        "{}",
        node.log_text()
    );
    assert!(
        node.log_text()
            .contains("starting from a Hugging Face model's weights"),
        "{}",
        node.log_text()
    );
    let checkpoint = newest_checkpoint(&data).expect("checkpoint");
    let e = eval_json(&checkpoint, Some(&cfg));
    eprintln!("one step from the fixture's weights: {e}");
    // The fixture was trained on Hamlet to about 2.9 nats a token; weights drawn from a seed
    // start at ln(384) = 5.95.
    let loss = e["loss"].as_f64().expect("loss");
    assert!(loss < 4.0, "{e}");
    assert_eq!(
        e["model"],
        "llama-v384-c64-l2-w64-i128-h4-k2-d16-e0.00001-r10000"
    );
    // The export names the folder it started from: the folder's 256 positions (the run read
    // 64), its generation and tokenizer files come along.
    let out = tmp.path().join("export");
    let (st, stdout, err) = cli(
        &[
            "export",
            "--checkpoint",
            checkpoint.to_str().expect("utf8"),
            "--out",
            out.to_str().expect("utf8"),
            "--base",
            fixture().to_str().expect("utf8"),
        ],
        Duration::from_secs(60),
    );
    assert!(st.success(), "{err}");
    assert!(
        stdout.contains("max_position_embeddings 256, generation_config.json, tokenizer.json"),
        "{stdout}"
    );
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).expect("config"))
            .expect("json");
    assert_eq!(config["max_position_embeddings"], 256);
    assert!(out.join("generation_config.json").is_file() && out.join("tokenizer.json").is_file());
}

/// `configs/smollm-135m-gpu.toml`, the GPU config of SmolLM-135M's shape, on the CPU: it loads
/// (its corpus, its tokenizer), builds a model of SmolLM-135M's 134,515,008 parameters, and
/// takes one training step at batch 1 on a 64-token window with the config's optimizer and
/// gradient clipping: a loss near `ln 49152` (the start is near uniform), a finite gradient
/// norm, the parameters moved.
#[test]
fn the_smollm_shaped_gpu_config_takes_a_step_on_the_cpu() {
    use p2ptrain_daemon::config::ModelConfig;
    use p2ptrain_models::{train, Model, Optimizer};

    let path = repo_root().join("configs/smollm-135m-gpu.toml");
    let mut config = p2ptrain_daemon::Config::load(Some(&path)).expect("the config loads");
    config.train.device = "cpu".parse().expect("cpu");
    config.train.batch_size = 1;
    let ModelConfig::Llama { spec, .. } = &mut config.model else {
        panic!("the config is not a llama's");
    };
    spec.context = 64;
    let prepared = p2ptrain_daemon::node::prepare(config).expect("prepared");
    let model = Model::new(&prepared.spec, 42, &prepared.device).expect("model");
    assert_eq!(model.params().numel(), 134_515_008, "SmolLM-135M's count");
    let c = &prepared.config;
    let mut opt = Optimizer::configured(&c.optimizer, c.schedule, &c.gradients, model.params())
        .expect("optimizer");
    let q_weights = |m: &Model| {
        m.params()
            .get("model.layers.0.self_attn.q_proj.weight")
            .expect("q_proj")
            .flatten_all()
            .and_then(|t| t.narrow(0, 0, 1000))
            .and_then(|t| t.to_vec1::<f32>())
            .expect("values")
    };
    let before = q_weights(&model);
    let (xs, ys) = prepared
        .data
        .train()
        .batch(&[0], &prepared.device)
        .expect("batch");
    assert_eq!(xs.dims(), [1, 64]);
    let loss = train::train_step(&model, &mut opt, &xs, &ys).expect("one step");
    let uniform = (49_152f32).ln();
    assert!(
        (loss - uniform).abs() < 0.5,
        "loss {loss}, uniform {uniform}"
    );
    let grad_norm = opt.last_grad_norm().expect("the config clips");
    assert!(grad_norm.is_finite() && grad_norm > 0.0, "{grad_norm}");
    assert_ne!(q_weights(&model), before, "the step moved nothing");
}

/// The fine-tune path a user takes across two boxes, on the committed fixture, in the
/// commands docs/huggingface.md gives: `p2ptrain init` writes the bundle (config, tokenizer,
/// text); the first box starts the run from the folder's weights; the second box has the
/// bundle only (its `model.hf` names a folder that is not there), joins under the same run
/// id and reads no folder; the two train `ddp` rounds together; the joiner's final checkpoint
/// exports as a Hugging Face folder with the base's files, and `sample` continues a prompt
/// from it with the bundle's config. A box with the bundle only cannot start the run itself:
/// it stops with an error naming the missing folder.
#[test]
fn a_fine_tune_from_init_trains_on_two_boxes_and_exports() {
    let _cores = crate::harness::cpu_hog();
    let tmp = tempfile::tempdir().expect("tmp");
    let path = |p: &Path| p.to_str().expect("utf8").to_string();
    let box1 = tmp.path().join("box1");
    let text = repo_root().join("data/hamlet.txt.gz");
    let (st, out, err) = cli(
        &[
            "init",
            "--hf",
            &path(&fixture()),
            "--text",
            &path(&text),
            "--out",
            &path(&box1),
            "--context",
            "64",
            "--sync-mode",
            "ddp",
        ],
        Duration::from_secs(120),
    );
    assert!(st.success(), "{err}");
    eprintln!("{out}");
    let digest = p2ptrain_models::hf::folder_digest(&fixture()).expect("digest");
    assert!(
        out.contains(&digest) && out.contains("p2ptrain join --config"),
        "{out}"
    );
    // The second box: the bundle, without the model folder.
    let box2 = tmp.path().join("box2");
    std::fs::create_dir(&box2).expect("box2");
    for file in ["p2ptrain.toml", "tokenizer.json", "hamlet.txt.gz"] {
        std::fs::copy(box1.join(file), box2.join(file)).expect(file);
    }
    let config = std::fs::read_to_string(box1.join("p2ptrain.toml")).expect("config");
    let elsewhere: String = config
        .lines()
        .map(|l| match l.starts_with("hf = ") {
            true => "hf = \"/nonexistent/hf-llama-tiny\"\n".to_string(),
            false => format!("{l}\n"),
        })
        .collect();
    assert_ne!(elsewhere, config, "the bundle names the folder: {config}");
    std::fs::write(box2.join("p2ptrain.toml"), elsewhere).expect("write");
    let (cfg1, cfg2) = (box1.join("p2ptrain.toml"), box2.join("p2ptrain.toml"));

    // Alone, the second box cannot start the run: it has no weights to start from.
    let mut founder = Node::start(
        &tmp.path().join("lone"),
        &["--config", &path(&cfg2), "--max-steps", "5"],
    );
    let status = founder.wait_exit(Duration::from_secs(60));
    let log = founder.log_text();
    assert!(!status.success(), "{log}");
    assert!(log.contains("not a Hugging Face folder here"), "{log}");

    let steps = "30";
    let extra = ["--max-steps", steps, "--min-members", "2"];
    let mut a = start(tmp.path(), "a", &cfg1, None, &extra);
    let addr = listen_addr(&a);
    let mut b = start(tmp.path(), "b", &cfg2, Some(&addr), &extra);
    let rounds = |s: &Value| s["rounds"]["completed"].as_u64().unwrap_or(0);
    let sa = a.wait_status("a round", Duration::from_secs(120), |s| rounds(s) > 0);
    let sb = b.wait_status("a round", Duration::from_secs(120), |s| rounds(s) > 0);
    assert_eq!(sa["run_id"], sb["run_id"]);
    for n in [&mut a, &mut b] {
        assert!(
            n.wait_exit(Duration::from_secs(300)).success(),
            "{}",
            n.log_text()
        );
    }
    assert!(
        a.log_text()
            .contains("starting from a Hugging Face model's weights"),
        "{}",
        a.log_text()
    );
    assert!(
        b.log_text().contains("the weights come from the mesh"),
        "{}",
        b.log_text()
    );

    // The joiner's last checkpoint, out as a Hugging Face folder on the base's files.
    let ck = newest_checkpoint(&tmp.path().join("b")).expect("the joiner's final checkpoint");
    let hf = tmp.path().join("hf");
    let (st, _, err) = cli(
        &[
            "export",
            "--checkpoint",
            &path(&ck),
            "--out",
            &path(&hf),
            "--base",
            &path(&fixture()),
        ],
        Duration::from_secs(60),
    );
    assert!(st.success(), "{err}");
    let folder = p2ptrain_models::hf::read_folder(&hf).expect("the export reads back");
    assert_eq!(folder.spec.vocab, 384);
    assert!(hf.join("generation_config.json").is_file());
    let (st, sample, err) = cli(
        &[
            "sample",
            "--checkpoint",
            &path(&ck),
            "--config",
            &path(&cfg2),
            "--prompt",
            "HAMLET.",
            "--bytes",
            "20",
        ],
        Duration::from_secs(60),
    );
    assert!(st.success(), "{err}");
    assert!(
        sample.starts_with("HAMLET.") && sample.len() > 20,
        "{sample}"
    );
}
