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
const STEPS: u64 = 1300;
/// `configs/text-gpt.toml` shrunk to a test size (2 layers of width 64, 32 bytes of context:
/// 0.12 M parameters; 16 windows a step, where a batch's noise leaves a second node's
/// something to average away), its schedule fitted to the step budget, plus `extra` TOML.
/// The config's warm-up of 200 steps is kept: with 100 a mesh, whose mean step is less noisy
/// than one node's, left the unigram plateau (about 4.6 bits per byte) 25-100 steps after the
/// lone node in some runs and never made up for it (gossip's pair took 0.94-0.98 of the lone
/// node's steps to the level in 4 of 15 runs, a `ddp` pair 0.92 where twice the batch needs
/// 0.71); with 200 every run leaves it with the lone node. (At a batch of 64 gossip's pair
/// gained nothing at the level: 625 steps, as the lone node.) Alone on one core of this box
/// 1,300 steps take about 30 s.
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
            ("batch_size = 32", "batch_size = 16"),
            ("total_steps = 10000", &total),
            ("eval_every_secs = 10", "eval_every_secs = 5"),
            ("every_secs = 60", "every_secs = 0"),
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

/// The level every run must reach (bits per byte, held out), and the margins fixed before
/// measuring: each mesh node must get there in at most this share of the steps the lone node
/// takes. One node with twice the batch needed 0.71 of them (`bench scaling`, one seed), the
/// ideal per step of two `ddp` nodes. Gossip's margin was fixed before its pair first ran
/// here, from `bench scaling` on this config (warm-up 100, each node on a core of its own):
/// 0.80-0.875 over four seeds.
const MESH_LEVEL: f64 = 2.8;
const DDP_MARGIN: f64 = 0.9;
const GOSSIP_MARGIN: f64 = 0.92;
/// No mesh node trains past this many steps; the schedule spans them (the lone node takes
/// 1,200 to the level, the same every time; two `ddp` nodes 825 each; gossip's pair 900-1,000
/// beside busy cores).
const MESH_STEP_CAP: u64 = 1500;

/// `text_config` evaluating every 25 steps (not on a clock), with a fixed data order, its
/// cosine schedule stretched over [`MESH_STEP_CAP`] steps. (Over the lone node's own steps
/// its curve flattens at the schedule's end near the level, and steps to a level on a flat
/// tail measure noise.)
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

/// Both nodes of `pair`, whose data directories are `dirs`, evaluated at or below
/// [`MESH_LEVEL`]: their statuses then. Fails if either ended [`MESH_STEP_CAP`] steps above it.
fn pair_at_level(pair: &[Node; 2], dirs: &[PathBuf; 2], what: &str) -> Vec<Value> {
    eventually(
        Duration::from_secs(400),
        &format!("both {what} nodes at the level"),
        || {
            if dirs.iter().any(|d| first_step_at(d, MESH_LEVEL).is_none()) {
                let last = dirs.iter().filter_map(|d| last_step(d)).min().unwrap_or(0);
                assert!(
                    last < MESH_STEP_CAP,
                    "the {what} nodes ended {MESH_STEP_CAP} steps above {MESH_LEVEL} bits per byte"
                );
                return None;
            }
            pair.iter().map(|n| n.status()).collect()
        },
    )
}

/// Steps the slower node of a pair took to [`MESH_LEVEL`] (both reached it).
fn pair_steps(dirs: &[PathBuf; 2]) -> u64 {
    dirs.iter()
        .filter_map(|d| first_step_at(d, MESH_LEVEL))
        .max()
        .expect("both reached")
}

/// The evaluated curve of the node in `dir`, `step:bits` pairs, for the test's output.
fn curve(dir: &Path) -> String {
    let points: Vec<String> = evals(dir)
        .iter()
        .map(|e| {
            format!(
                "{}:{:.2}",
                e["step"],
                e["bits_per_byte"].as_f64().unwrap_or(0.0)
            )
        })
        .collect();
    points.join(" ")
}

/// A pair's mesh, as it stands at the level: its one peer, nothing rejected, nobody banned.
fn assert_a_clean_pair(s: &Value, mode: &str) {
    assert_eq!(s["sync"]["mode"], mode, "{s}");
    assert_eq!(peers(s), 1, "{s}");
    assert_eq!(s["updates"]["rejected"].as_u64(), Some(0), "{s}");
    assert!(
        s["banned_peers"].as_array().is_none_or(Vec::is_empty),
        "{s}"
    );
}

/// The `[sync]` body of gossip's pair: the seeds' asynchronous exchange, each node publishing
/// its change every step at one bit a value (error feedback keeps what the sign dropped), and
/// taking the mean of its own and its neighbour's (`mix = "mean"`, as one node with twice the
/// batch would move). With the SSP bound neither runs more than 16 steps ahead of the other:
/// on CI's two busy cores the pair's speeds differ, and a fast node's step would otherwise mix
/// in changes from far behind.
const GOSSIP_SYNC: &str = "mode = \"gossip\"\nmix = \"mean\"\npublish_every = 1\ncodec = \"onebit\"\nerror_feedback = true\nstaleness_bound = 16\n";

/// The most a gossip node may send, in all (updates, syncs, heartbeats, libp2p's own), per
/// step it took: this share of a dense `f32` update. One bit a value is 1/32 of it; the rest
/// is room for the envelope, the full syncs and the mesh's chatter.
const GOSSIP_BYTES_PER_STEP_SHARE: f64 = 1.0 / 16.0;

/// More boxes, sooner, counted in steps: two `ddp` nodes (each step's gradients summed in the
/// ring, so a step of the mesh sees twice the batch) reach [`MESH_LEVEL`] in at most
/// [`DDP_MARGIN`] of the steps one node alone takes from the same start and data order, and
/// two `gossip` nodes (the low-communication exchange of [`GOSSIP_SYNC`]) in at most
/// [`GOSSIP_MARGIN`] of them, sending at most [`GOSSIP_BYTES_PER_STEP_SHARE`] of a dense
/// update a step; in both, nothing rejected and nobody banned, and the `ddp` pair holding the
/// same bits. Counted in steps (each node's evaluations, every 25 steps), never seconds, so a
/// loaded box changes nothing but gossip's staleness. The one lone control serves both:
/// gossip has no outer optimizer, so one node with the config's optimizer is the better lone
/// control. It is also the GPT alone whose checkpoint [`check_the_lone_gpt`] checks (one GPT
/// run fewer on CI's two cores than a test of its own).
#[test]
fn two_ddp_and_two_gossip_gpt_nodes_take_fewer_steps_than_a_lone_node_whose_checkpoint_reads() {
    let _cores = crate::harness::cpu_hog();
    let tmp = tempfile::tempdir().expect("tmp");
    // The lone node runs [`STEPS`] steps (its data order is pinned, so it takes the same
    // number every time) and is the lone GPT whose checkpoint is checked at the end.
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
    let gossip = start_pair(tmp.path(), ["g1", "g2"], GOSSIP_SYNC);

    // Status carries the language model's figures while it trains.
    let alone_status = alone.wait_status("a text evaluation", Duration::from_secs(120), |s| {
        s["eval"]["bits_per_byte"].is_number()
    });

    // Both gossip nodes at the level, having taken each other's changes within the budget.
    let gossip_dirs = ["g1", "g2"].map(|n| tmp.path().join(n));
    for s in pair_at_level(&gossip, &gossip_dirs, "gossip") {
        eprintln!(
            "gossip node: step {} bytes sent {} updates {} sync {}",
            s["step"], s["bytes_sent"], s["updates"], s["sync"]
        );
        assert_a_clean_pair(&s, "gossip");
        assert!(s["updates"]["applied"].as_u64().unwrap_or(0) > 0, "{s}");
        let steps = s["step"].as_f64().expect("step");
        let dense = s["sync"]["dense_update_bytes"]
            .as_f64()
            .expect("dense bytes");
        let sent = s["bytes_sent"].as_f64().expect("bytes sent");
        assert!(
            sent <= steps * dense * GOSSIP_BYTES_PER_STEP_SHARE,
            "{sent} bytes sent in {steps} steps, a dense update being {dense}"
        );
    }
    let gossip_steps = pair_steps(&gossip_dirs);
    drop(gossip);

    // Whole batches on both ddp members: this counts steps, and three GPT processes on two
    // cores (more on a busy CI box) make the members' speeds differ at the scheduler's whim;
    // balanced batches would trade samples per step for time, which a count of steps reads
    // as a loss. `modes::a_slow_ddp_member_takes_a_smaller_batch_and_the_members_stay_identical`
    // tests the balancing. (Without `min_members = 2` the founder stepped alone until the
    // joiner came in, and the count varied from run to run.)
    let ddp = start_pair(
        tmp.path(),
        ["a", "b"],
        "mode = \"ddp\"\nbalance_batches = false\n",
    );
    let ddp_dirs = ["a", "b"].map(|n| tmp.path().join(n));
    let finals = pair_at_level(&ddp, &ddp_dirs, "ddp");
    for s in &finals {
        eprintln!("ddp node: step {} rounds {}", s["step"], s["rounds"]);
        assert_a_clean_pair(s, "ddp");
        assert_eq!(s["rounds"]["ring_size"].as_u64(), Some(2), "{s}");
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
    let ddp_steps = pair_steps(&ddp_dirs);
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
    for (name, dir) in [
        ("g1", &gossip_dirs[0]),
        ("g2", &gossip_dirs[1]),
        ("a", &ddp_dirs[0]),
        ("b", &ddp_dirs[1]),
        ("alone", &alone_dir),
    ] {
        eprintln!("{name}: {}", curve(dir));
    }
    let ddp_share = ddp_steps as f64 / alone_steps as f64;
    let gossip_share = gossip_steps as f64 / alone_steps as f64;
    eprintln!(
        "to {MESH_LEVEL} bits per byte: alone {alone_steps} steps, each ddp node {ddp_steps} ({ddp_share:.2} of them), each gossip node {gossip_steps} ({gossip_share:.2})"
    );
    assert!(
        ddp_share <= DDP_MARGIN,
        "two ddp nodes took {ddp_steps} steps each to {MESH_LEVEL} bits per byte, one node alone {alone_steps}"
    );
    assert!(
        gossip_share <= GOSSIP_MARGIN,
        "two gossip nodes took {gossip_steps} steps each to {MESH_LEVEL} bits per byte, one node alone {alone_steps}"
    );
}
