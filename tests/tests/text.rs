//! The byte-level GPT on the bundled Hamlet: a node alone brings held-out bits per byte below
//! 3.0 (the unigram entropy of English text is about 4.5); two `ddp` nodes reach 2.8 in fewer
//! steps each than it; `sample` prints text from its checkpoint; the checkpoint reads in a
//! plain safetensors reader under the names docs/huggingface.md documents.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::harness::{
    cli, edited_config, eval_json, evals, eventually, newest_checkpoint, read_checkpoint, Node,
};
use crate::mesh::{listen_addr, peers, start};

/// The target: below the unigram entropy by far, above what the model reaches at the end.
const TARGET_BITS_PER_BYTE: f64 = 3.0;
/// The step budget of a node alone (the meshes' lone control, whose checkpoint is checked).
const STEPS: u64 = 700;
/// `configs/text-gpt.toml` shrunk to a test size (2 layers of width 64, 32 bytes of context:
/// 0.12 M parameters; 64 windows a step), its schedule fitted to the step budget, plus `extra`
/// TOML. Alone on this 2-core box 600 steps took about 100 s and ended at 2.82 bits per byte.
fn text_config(dir: &Path, name: &str, steps: u64, extra: &str) -> PathBuf {
    let total = format!("total_steps = {steps}");
    edited_config(
        dir,
        name,
        "configs/text-gpt.toml",
        &[
            ("context = 64", "context = 32"),
            ("layers = 4", "layers = 2"),
            ("width = 128", "width = 64"),
            ("batch_size = 32", "batch_size = 64"),
            ("total_steps = 10000", &total),
            ("eval_every_secs = 10", "eval_every_secs = 5"),
            ("every_secs = 60", "every_secs = 0"),
            // The step counts below were measured with this warm-up (the full-size config's
            // warm-up is longer, for its larger model and batch).
            ("warmup_steps = 200", "warmup_steps = 100"),
        ],
        extra,
    )
}

/// The lone node's checks, once it ran [`STEPS`] steps from `cfg` in `data`: while it
/// trained, status carried the language model's figures (`status`, read after its first
/// evaluation); it exited by itself; its final checkpoint is below
/// [`TARGET_BITS_PER_BYTE`], `sample` prints text from it, and a plain safetensors reader sees
/// the documented names.
fn check_the_lone_gpt(tmp: &Path, node: &mut Node, status: &Value, data: &Path, cfg: &Path) {
    let s = status;
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

    let ck = newest_checkpoint(data).expect("final checkpoint");
    let e = eval_json(&ck, Some(cfg));
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
    let other = text_config(tmp, "other.toml", STEPS, "")
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

/// The level both runs must reach (bits per byte, held out), and the margin fixed before
/// measuring: the mesh's nodes must get there in at most this share of the steps the lone
/// node takes. One node with twice the batch would need about 0.7 of them (the ideal per
/// step of two `ddp` nodes).
const MESH_LEVEL: f64 = 2.8;
const MESH_MARGIN: f64 = 0.9;
/// No mesh node trains past this many steps; the schedule spans them (the lone node takes
/// 625 to the level, two `ddp` nodes 450 each, reproducibly).
const MESH_STEP_CAP: u64 = 1500;

/// `text_config` evaluating every 25 steps (not on a clock), with a fixed data order, its
/// cosine schedule stretched over [`MESH_STEP_CAP`] steps. (Over 700, as the lone test has
/// it, a lone node's curve flattened at the schedule's end just above 2.8: 2.84 at step 600,
/// 2.80 at 800. A mesh run that came near the level late crawled there too, once taking 750
/// steps where the same test had taken 475: steps to a level on a flat tail measure noise.)
fn steps_config(dir: &Path, name: &str, node_seed: u64, extra: &str) -> PathBuf {
    let path = text_config(dir, name, MESH_STEP_CAP, extra);
    let text = std::fs::read_to_string(&path).expect("config");
    let mut text = text
        .replace("eval_every = 0", "eval_every = 25")
        .replace("eval_every_secs = 5", "eval_every_secs = 0")
        .replace(
            "init_seed = 42",
            &format!("init_seed = 42\nnode_seed = {node_seed}"),
        );
    text.push('\n');
    std::fs::write(&path, text).expect("write config");
    path
}

/// The first evaluated step of the node in `dir` at or below `level` bits per byte, from its
/// eval log.
fn first_step_at(dir: &Path, level: f64) -> Option<u64> {
    evals(dir)
        .into_iter()
        .find(|e| e["bits_per_byte"].as_f64().is_some_and(|b| b <= level))
        .and_then(|e| e["step"].as_u64())
}

/// The last evaluated step in the eval log of the node in `dir`.
fn last_step(dir: &Path) -> Option<u64> {
    evals(dir).last()?["step"].as_u64()
}

/// Two members of a mesh, started together from one state: `mode_toml` is their `[sync]`
/// section's body (`min_members = 2` added: both take their first step together, so the
/// mesh's run is as reproducible as the lone node's).
fn start_pair(root: &Path, names: [&str; 2], mode_toml: &str) -> [Node; 2] {
    let cap = MESH_STEP_CAP.to_string();
    let mesh = format!("\n[sync]\nmin_members = 2\n{mode_toml}");
    let cfg_a = steps_config(root, &format!("{}.toml", names[0]), 1, &mesh);
    let cfg_b = steps_config(root, &format!("{}.toml", names[1]), 2, &mesh);
    let a = start(root, names[0], &cfg_a, None, &["--max-steps", &cap]);
    let addr = listen_addr(&a);
    let b = start(root, names[1], &cfg_b, Some(&addr), &["--max-steps", &cap]);
    [a, b]
}

/// More boxes, sooner, counted in steps: two `ddp` nodes (each step's gradients summed in the
/// ring, so a step of the mesh sees twice the batch) reach [`MESH_LEVEL`] in at most
/// [`MESH_MARGIN`] of the steps one node alone takes from the same start and data order, with
/// nothing rejected, nobody banned, and the two holding the same bits. Counted in steps (each
/// node's evaluations, every 25 steps), never seconds, so a loaded box changes nothing. The
/// lone node is also the GPT alone whose checkpoint [`check_the_lone_gpt`] checks (one GPT
/// run fewer on CI's two cores than a test of its own).
#[test]
fn two_ddp_gpt_nodes_take_fewer_steps_than_a_lone_node_whose_checkpoint_samples_and_reads() {
    let _cores = crate::harness::cpu_hog();
    let tmp = tempfile::tempdir().expect("tmp");
    // The lone node runs [`STEPS`] steps (it reaches the level at 625, the same every time:
    // its data order is pinned) and is the lone GPT whose checkpoint is checked at the end.
    let alone_cfg = steps_config(tmp.path(), "alone.toml", 1, "");
    let alone_dir = tmp.path().join("alone");
    let mut alone = Node::start(
        &alone_dir,
        &[
            "--config",
            alone_cfg.to_str().expect("utf8"),
            "--max-steps",
            &STEPS.to_string(),
        ],
    );
    alone.wait_api();
    // Whole batches on both ddp members: this counts steps, and three GPT processes on two
    // cores (more on a busy CI box) make the members' speeds differ at the scheduler's whim;
    // balanced batches would trade samples per step for time, which a count of steps reads
    // as a loss. `modes::a_slow_ddp_member_takes_a_smaller_batch_and_the_members_stay_identical`
    // tests the balancing. (Without `min_members = 2` the founder stepped alone until the
    // joiner came in, and the count varied from run to run: 450 to 575 of the lone node's
    // 625, one run in three above the margin.)
    let ddp = start_pair(
        tmp.path(),
        ["a", "b"],
        "mode = \"ddp\"\nbalance_batches = false\n",
    );

    // Status carries the language model's figures while it trains.
    let alone_status = alone.wait_status("a text evaluation", Duration::from_secs(120), |s| {
        s["eval"]["bits_per_byte"].is_number()
    });

    // Both ddp nodes at the level, in rounds of two.
    let dirs = ["a", "b"].map(|n| tmp.path().join(n));
    let finals: Vec<Value> = eventually(
        Duration::from_secs(400),
        "both ddp nodes at the level",
        || {
            if dirs.iter().any(|d| first_step_at(d, MESH_LEVEL).is_none()) {
                let last = dirs.iter().filter_map(|d| last_step(d)).min().unwrap_or(0);
                assert!(
                    last < MESH_STEP_CAP,
                    "the ddp nodes ended {MESH_STEP_CAP} steps above {MESH_LEVEL} bits per byte"
                );
                return None;
            }
            ddp.iter().map(|n| n.status()).collect()
        },
    );
    for s in &finals {
        eprintln!("ddp node: step {} rounds {}", s["step"], s["rounds"]);
        assert_eq!(s["sync"]["mode"], "ddp", "{s}");
        assert_eq!(peers(s), 1, "{s}");
        assert_eq!(s["rounds"]["ring_size"].as_u64(), Some(2), "{s}");
        assert_eq!(s["updates"]["rejected"].as_u64(), Some(0), "{s}");
        assert!(
            s["banned_peers"].as_array().is_none_or(Vec::is_empty),
            "{s}"
        );
    }
    // The same bits on both: a digested round they share agrees.
    let digests: Vec<_> = finals.iter().map(crate::modes::digests).collect();
    let shared: Vec<u64> = digests[0]
        .keys()
        .filter(|r| digests[1].contains_key(r))
        .copied()
        .collect();
    assert!(
        !shared.is_empty(),
        "no digested round in common: {digests:?}"
    );
    for r in shared {
        assert_eq!(
            digests[0][&r], digests[1][&r],
            "the members differ at round {r}"
        );
    }
    let mesh_steps = dirs
        .iter()
        .filter_map(|d| first_step_at(d, MESH_LEVEL))
        .max()
        .expect("both reached");
    drop(ddp);

    check_the_lone_gpt(
        tmp.path(),
        &mut alone,
        &alone_status,
        &alone_dir,
        &alone_cfg,
    );
    let alone_steps = first_step_at(&alone_dir, MESH_LEVEL)
        .unwrap_or_else(|| panic!("the lone node ended {STEPS} steps above {MESH_LEVEL}"));
    for (name, dir) in [("a", &dirs[0]), ("b", &dirs[1]), ("alone", &alone_dir)] {
        let curve: Vec<String> = evals(dir)
            .iter()
            .map(|e| {
                format!(
                    "{}:{:.2}",
                    e["step"],
                    e["bits_per_byte"].as_f64().unwrap_or(0.0)
                )
            })
            .collect();
        eprintln!("{name}: {}", curve.join(" "));
    }
    let share = mesh_steps as f64 / alone_steps as f64;
    eprintln!(
        "to {MESH_LEVEL} bits per byte: alone {alone_steps} steps, each ddp node {mesh_steps} ({share:.2} of them)"
    );
    assert!(
        share <= MESH_MARGIN,
        "two ddp nodes took {mesh_steps} steps each to {MESH_LEVEL} bits per byte, one node alone {alone_steps}"
    );
}
