//! The byte-level GPT on the bundled Hamlet: a node brings held-out bits per byte below 3.0
//! (the unigram entropy of English text is about 4.5), alone and in a 2-node mesh whose
//! updates are 1-bit (`onebit`: a sign per value, a scale per row); `sample` prints text from
//! its checkpoint; the checkpoint reads in a plain safetensors reader under the names the
//! README documents.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::harness::{cli, newest_checkpoint, read_checkpoint, repo_root, Node};
use crate::mesh::{listen_addr, peers, start};

/// The target: below the unigram entropy by far, above what the model reaches at the end.
const TARGET_BITS_PER_BYTE: f64 = 3.0;
/// The step budget of a node alone.
const STEPS: u64 = 700;
/// The step budget of each node of the 1-bit mesh: its updates arrive late and compressed,
/// so it gets more. With 700 steps (as alone) 2-node `onebit` meshes ended at 2.95 and 2.96
/// bits per byte, too near the target for a test; with 900, at 2.73-2.77.
const MESH_STEPS: u64 = 900;

/// `configs/text-gpt.toml` shrunk to a test size (2 layers of width 64, 32 bytes of context:
/// 0.12 M parameters; 64 windows a step), its schedule fitted to the step budget, plus `extra`
/// TOML. Alone on this 2-core box 600 steps took about 100 s and ended at 2.82 bits per byte.
fn text_config(dir: &Path, name: &str, steps: u64, extra: &str) -> PathBuf {
    let mut text =
        std::fs::read_to_string(repo_root().join("configs/text-gpt.toml")).expect("config");
    for (from, to) in [
        ("context = 64", "context = 32"),
        ("layers = 4", "layers = 2"),
        ("width = 128", "width = 64"),
        ("batch_size = 32", "batch_size = 64"),
        ("total_steps = 10000", &format!("total_steps = {steps}")),
        ("eval_every_secs = 10", "eval_every_secs = 5"),
        ("every_secs = 60", "every_secs = 0"),
    ] {
        assert!(text.contains(from), "{from}");
        text = text.replace(from, to);
    }
    text.push_str(extra);
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

fn eval_json(cfg: &Path, checkpoint: &Path) -> Value {
    let (st, out, err) = cli(
        &[
            "eval",
            "--json",
            "--config",
            cfg.to_str().expect("utf8"),
            "--checkpoint",
            checkpoint.to_str().expect("utf8"),
        ],
        Duration::from_secs(120),
    );
    assert!(st.success(), "{err}");
    serde_json::from_str(&out).expect("json")
}

#[test]
fn a_gpt_alone_goes_below_3_bits_per_byte_and_its_checkpoint_samples_and_reads_plainly() {
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = text_config(tmp.path(), "text.toml", STEPS, "");
    let data = tmp.path().join("node");
    let cfg_arg = cfg.to_str().expect("utf8");
    let mut node = Node::start(
        &data,
        &["--config", cfg_arg, "--max-steps", &STEPS.to_string()],
    );
    node.wait_api();
    // Status carries the language model's figures while it trains.
    let s = node.wait_status("a text evaluation", Duration::from_secs(120), |s| {
        s["eval"]["bits_per_byte"].is_number()
    });
    let (bpb, ppl, loss) = (
        s["eval"]["bits_per_byte"].as_f64().expect("bpb"),
        s["eval"]["perplexity"].as_f64().expect("perplexity"),
        s["eval"]["loss"].as_f64().expect("loss"),
    );
    assert!((bpb - loss / std::f64::consts::LN_2).abs() < 1e-9, "{s}");
    assert!((ppl - loss.exp()).abs() < 1e-6 * ppl, "{s}");
    assert!(
        node.wait_exit(Duration::from_secs(600)).success(),
        "{}",
        node.log_text()
    );

    let ck = newest_checkpoint(&data).expect("final checkpoint");
    let e = eval_json(&cfg, &ck);
    eprintln!("alone after {STEPS} steps: {e}");
    assert_eq!(e["step"], STEPS);
    let bpb = e["bits_per_byte"].as_f64().expect("bits_per_byte");
    assert!(
        bpb < TARGET_BITS_PER_BYTE,
        "held-out {bpb:.3} bits per byte"
    );

    // `sample` prints the prompt, the requested bytes and a newline, from the file alone.
    let prompt = "HAMLET.\n";
    let ck_arg = ck.to_str().expect("utf8");
    let args = [
        "sample",
        "--checkpoint",
        ck_arg,
        "--prompt",
        prompt,
        "--bytes",
        "150",
    ];
    // Its output is read as bytes: a byte model may print any byte.
    let sample = || {
        let out = std::process::Command::new(crate::harness::bin())
            .args(args)
            .output()
            .expect("run sample");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    let out = sample();
    eprintln!("sample:\n{}", String::from_utf8_lossy(&out));
    assert_eq!(out.len(), prompt.len() + 150 + 1, "{out:?}");
    assert!(out.starts_with(prompt.as_bytes()));
    // Seeded: the same command gives the same text; a wrong config is refused.
    assert_eq!(sample(), out);
    let other = text_config(tmp.path(), "other.toml", STEPS, "")
        .to_str()
        .map(str::to_owned)
        .expect("utf8");
    let text = std::fs::read_to_string(&other)
        .expect("read")
        .replace("init_seed = 42", "init_seed = 7");
    std::fs::write(&other, text).expect("write");
    let (st, _, err) = cli(
        &["sample", "--checkpoint", ck_arg, "--config", &other],
        Duration::from_secs(60),
    );
    assert!(!st.success() && err.contains("is from run"), "{err}");

    // A plain safetensors reader sees the documented names and shapes.
    let (_, tensors) = read_checkpoint(&ck);
    for (name, shape) in [
        ("tok_emb.weight", vec![256, 64]),
        ("pos_emb.weight", vec![32, 64]),
        ("blocks.0.ln1.weight", vec![64]),
        ("blocks.0.attn.qkv.weight", vec![192, 64]),
        ("blocks.0.attn.proj.weight", vec![64, 64]),
        ("blocks.1.mlp.fc.weight", vec![256, 64]),
        ("blocks.1.mlp.proj.weight", vec![64, 256]),
        ("ln_f.bias", vec![64]),
        ("optim.adam_m.tok_emb.weight", vec![256, 64]),
        ("optim.adam_v.blocks.1.mlp.fc.bias", vec![256]),
    ] {
        let (got, values) = tensors
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(got, &shape, "{name}");
        assert!(values.iter().all(|v| v.is_finite()), "{name}");
    }
}

/// 1-bit updates (`onebit`, a scale per row) with error feedback, [`MESH_STEPS`] each. With
/// one scale per tensor (`onebit-tensor`) every byte the text rarely uses gets the tensor's
/// mean magnitude in its embedding row, which is also its output weight: such meshes ended at
/// 2.85-3.07 bits per byte after 600-700 steps.
#[test]
fn two_gpt_nodes_with_1_bit_updates_go_below_3_bits_per_byte() {
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = text_config(
        tmp.path(),
        "text.toml",
        MESH_STEPS,
        "\n[sync]\ncodec = \"onebit\"\nerror_feedback = true\n",
    );
    let steps = MESH_STEPS.to_string();
    let a = start(tmp.path(), "a", &cfg, None, &["--max-steps", &steps]);
    let addr = listen_addr(&a);
    let b = start(tmp.path(), "b", &cfg, Some(&addr), &["--max-steps", &steps]);
    let mut nodes = [a, b];
    // Watch the mesh while it trains: one peer each, updates flowing both ways, none refused.
    let mut seen: Vec<Value> = Vec::new();
    for n in &nodes {
        seen.push(n.wait_status(
            "a peer and applied 1-bit updates",
            Duration::from_secs(300),
            |s| peers(s) == 1 && s["updates"]["applied"].as_u64().unwrap_or(0) >= 5,
        ));
    }
    for s in &seen {
        assert_eq!(s["updates"]["rejected"].as_u64(), Some(0), "{s}");
        assert!(
            s["banned_peers"].as_array().is_none_or(Vec::is_empty),
            "{s}"
        );
    }
    for n in &mut nodes {
        assert!(
            n.wait_exit(Duration::from_secs(600)).success(),
            "{}",
            n.log_text()
        );
    }
    for name in ["a", "b"] {
        let ck = newest_checkpoint(&tmp.path().join(name)).expect("final checkpoint");
        let e = eval_json(&cfg, &ck);
        eprintln!("node {name} in a 1-bit mesh after {MESH_STEPS} steps: {e}");
        let bpb = e["bits_per_byte"].as_f64().expect("bits_per_byte");
        assert!(
            bpb < TARGET_BITS_PER_BYTE,
            "node {name}: {bpb:.3} bits per byte"
        );
    }
}
