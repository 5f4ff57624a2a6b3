#!/usr/bin/env python3
"""Makes models/fixtures/hf-llama-tiny/, a tiny Hugging Face Llama with transformers' own numbers.

Why: p2ptrain's Rust Llama-family decoder (and its Hugging Face import/export) must agree with
transformers, but CI has no torch. This script writes, once, a small model in Hugging Face's own
format together with the logits and loss transformers computes for it, so that Rust tests can
load the folder and compare against committed numbers.

What it writes (the folder is wiped and rewritten on every run):
  tokenizer.json         byte-level BPE (vocab 384, no special tokens) trained on data/hamlet.txt.gz
  config.json, generation_config.json, model.safetensors
                         LlamaForCausalLM (2 layers, hidden 64, 4 query heads over 2 key/value heads,
                         head_dim 16, untied lm_head), float32, briefly trained on Hamlet so that
                         attention and rotary embeddings matter (a plain 0.02-std initialisation
                         would hide a wrong rotary convention or head mapping)
  bf16/                  the same trained weights in bfloat16, sharded (model-0000x-of-0000y.safetensors
                         + model.safetensors.index.json): the sharded / bf16 import path
  expected.safetensors   input_ids [2, 24] (int64, a Hamlet passage), logits [2, 24, 384] and loss
                         (labels = input_ids, transformers' shifted mean cross-entropy) of the f32
                         folder reloaded with from_pretrained; logits_bf16 / loss_bf16 of the bf16
                         folder loaded with dtype=float32 (bf16 weights upcast, as p2ptrain imports)
  expected.json          the losses in full precision, a tokenizer check (ids and bytes per token of
                         a text with punctuation, newlines and non-ASCII), versions, config, training
                         figures, how much a wrong rotary / head mapping moves the logits, and the
                         sha256 of every other fixture file

It also checks what it wrote: reloading logs no missing / unexpected key, reloaded logits equal the
in-memory model's, the bf16 weights are the f32 ones rounded; it fails otherwise.

To rerun (CPU only, about half a minute), from the repository root:
  python3 -m venv /tmp/hfenv
  /tmp/hfenv/bin/pip install -r bench/hf_fixture/requirements.txt
  /tmp/hfenv/bin/python bench/hf_fixture/make_fixture.py
Everything is seeded and single-threaded: reruns on one machine give identical files. Another CPU
or library build may change the last bits of the trained weights, hence every number; commit the
folder's files together, and check a folder against them with bench/hf_fixture/check_export.py.
"""

import copy
import gzip
import hashlib
import json
import math
import os
import pathlib
import platform
import random
import shutil
import sys
import time

# Before importing tokenizers: its BPE trainer otherwise runs on a thread pool.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is made here; never reach the hub

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from check_export import load_checked, run  # noqa: E402  (the same checked load as the checker)

REPO = pathlib.Path(__file__).resolve().parents[2]
HAMLET = REPO / "data/hamlet.txt.gz"
OUT = REPO / "models/fixtures/hf-llama-tiny"
BF16 = OUT / "bf16"

SEED = 1234
VOCAB = 384
TRAIN = dict(steps=300, lr=3e-3, batch=16, seq=64, betas=(0.9, 0.95), weight_decay=0.0,
             grad_clip=1.0)
PASSAGE_START = "To be, or not to be"  # the expected values' input: from the line holding this
EXPECTED_SHAPE = (2, 24)
# Tokenizer check text: ASCII punctuation, newlines, a 2-byte "é" and a 3-byte "—".
TOKENIZER_CHECK_TEXT = "Ay, there's the rub;\nO, what a rogue—and café-slave am I!\n\n  (Exit.)"

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: 2 query heads per key/value head
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,  # transformers 5 stores it as rope_parameters.rope_theta
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    hidden_act="silu",
    # The tokenizer has no special tokens, so there are none to name.
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    dtype="float32",
)


def seed_everything():
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in the output
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    try:
        torch.use_deterministic_algorithms(True)
    except Exception as e:  # not every build supports it; single-threaded CPU is deterministic anyway
        print(f"note: use_deterministic_algorithms unavailable: {e}")


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bytes_to_unicode():
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train_tokenizer(text):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is unknown
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def tokenizer_check(tok):
    """Ids of TOKENIZER_CHECK_TEXT and, per token, the bytes of the UTF-8 text it stands for."""
    table = bytes_to_unicode()
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    unbyte = {c: b for b, c in table.items()}
    enc = tok.encode(TOKENIZER_CHECK_TEXT)
    pieces = [bytes(unbyte[c] for c in tok.id_to_token(i)) for i in enc.ids]
    # Byte-level BPE is lossless: the tokens' bytes are the text's bytes, in order.
    assert b"".join(pieces) == TOKENIZER_CHECK_TEXT.encode("utf-8")
    assert tok.decode(enc.ids) == TOKENIZER_CHECK_TEXT
    return {
        "text": TOKENIZER_CHECK_TEXT,
        "utf8_len": len(TOKENIZER_CHECK_TEXT.encode("utf-8")),
        "ids": enc.ids,
        "token_bytes": [len(p) for p in pieces],
        "token_bytes_hex": [p.hex() for p in pieces],
    }


def train_model(config, ids):
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"], betas=TRAIN["betas"],
                            weight_decay=TRAIN["weight_decay"])
    data = torch.tensor(ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(SEED)
    seq, batch = TRAIN["seq"], TRAIN["batch"]
    losses = []
    for step in range(TRAIN["steps"]):
        starts = torch.randint(0, len(data) - seq, (batch,), generator=gen)
        x = torch.stack([data[s:s + seq] for s in starts])
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"])
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == TRAIN["steps"] - 1:
            print(f"  step {step:3d}  loss {loss.item():.4f}")
    model.eval()
    return model, losses


def attention_figures(model, input_ids):
    """Entropy of the trained model's attention against uniform causal attention's."""
    with torch.no_grad():
        att = model(input_ids=input_ids, output_attentions=True, use_cache=False).attentions
    seq = input_ids.shape[1]
    uniform = sum(math.log(i + 1) for i in range(seq)) / seq  # mean over query positions
    per_head = []
    for layer in att:  # [batch, heads, query, key]
        p = layer.double().clamp_min(1e-30)
        ent = -(layer.double() * p.log()).sum(-1)  # [batch, heads, query]
        per_head.append([round(v, 4) for v in ent.mean(dim=(0, 2)).tolist()])
    return {
        "mean_entropy_per_layer_head_nats": per_head,
        "uniform_causal_mean_entropy_nats": round(uniform, 4),
        "mean_max_attention_weight": round(
            float(torch.stack([a.max(-1).values.mean() for a in att]).mean()), 4),
    }


def sensitivity(model, input_ids, logits):
    """How far the logits move under the usual import mistakes (max |difference|)."""
    cfg = model.config
    d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    out = {}
    with torch.no_grad():
        # No rotary at all: position 0 everywhere makes every rotation the identity.
        z = model(input_ids=input_ids, position_ids=torch.zeros_like(input_ids)).logits
        out["rotary_off"] = (z - logits).abs().max().item()

        # Interleaved rotary pairs (2i, 2i+1) read on HF's half-split layout (i, i + d/2): the
        # same as HF's code on q/k rows reordered [0, 2, 4, .., 1, 3, 5, ..] within each head.
        perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
        m = copy.deepcopy(model)
        for layer in m.model.layers:
            for proj, heads in ((layer.self_attn.q_proj, nh), (layer.self_attn.k_proj, nkv)):
                w = proj.weight.view(heads, d, -1)
                proj.weight.copy_(w[:, perm].reshape(heads * d, -1))
        out["rotary_interleaved"] = (m(input_ids=input_ids).logits - logits).abs().max().item()

        # Query head h on key/value head h % n_kv instead of h // (n_heads / n_kv): the same as HF's
        # code with query heads (and o_proj's matching input columns) reordered [0, 2, 1, 3].
        order = torch.arange(nh).view(nkv, nh // nkv).t().reshape(-1)
        m = copy.deepcopy(model)
        for layer in m.model.layers:
            q, o = layer.self_attn.q_proj, layer.self_attn.o_proj
            q.weight.copy_(q.weight.view(nh, d, -1)[order].reshape(nh * d, -1))
            o.weight.copy_(o.weight.view(-1, nh, d)[:, order].reshape(-1, nh * d))
        out["kv_head_mapping_modulo"] = (m(input_ids=input_ids).logits - logits).abs().max().item()
    return out


def describe(folder):
    """Tensor name -> [dtype, shape] for every safetensors file of a folder."""
    rows = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as s:
            for k in s.keys():
                sl = s.get_slice(k)
                rows[k] = {"file": f.name, "dtype": sl.get_dtype(), "shape": sl.get_shape()}
    return rows


def main():
    t0 = time.perf_counter()
    seed_everything()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)

    text = gzip.decompress(HAMLET.read_bytes()).decode("utf-8")

    # 1. Tokenizer.
    tok = train_tokenizer(text)
    tok.save(str(OUT / "tokenizer.json"))
    tok = Tokenizer.from_file(str(OUT / "tokenizer.json"))  # use what was saved from here on
    tok_check = tokenizer_check(tok)
    ids = tok.encode(text).ids
    print(f"tokenizer: vocab {tok.get_vocab_size()}, Hamlet = {len(ids)} tokens "
          f"({len(text.encode()) / len(ids):.2f} bytes/token)  [{time.perf_counter() - t0:.1f}s]")

    # 2. Model, briefly trained.
    config = LlamaConfig(**CONFIG)
    config._attn_implementation = "eager"
    t1 = time.perf_counter()
    model, losses = train_model(config, ids)
    final_loss = losses[-1]
    print(f"trained {TRAIN['steps']} steps in {time.perf_counter() - t1:.1f}s, "
          f"final loss {final_loss:.4f} (first {losses[0]:.4f}, ln {VOCAB} = {math.log(VOCAB):.4f})")

    # 3. Save: f32 in one file, bf16 sharded.
    model.save_pretrained(OUT)  # transformers 5 always writes safetensors (safe_serialization is gone)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.save_pretrained(BF16, max_shard_size="100KB")
    shards = sorted(BF16.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and (BF16 / "model.safetensors.index.json").exists(), shards
    assert not (BF16 / "model.safetensors").exists()

    # 4. Expected values on a fixed Hamlet passage.
    start = text.rindex("\n", 0, text.index(PASSAGE_START)) + 1
    n = EXPECTED_SHAPE[0] * EXPECTED_SHAPE[1]
    passage_ids = tok.encode(text[start:start + 4 * n]).ids[:n]  # 4 bytes a token is plenty
    assert len(passage_ids) == n
    input_ids = torch.tensor(passage_ids, dtype=torch.long).view(EXPECTED_SHAPE)

    logits_mem, loss_mem = run(model, input_ids)
    # 5. Reload (failing on any key warning) and check against the in-memory model.
    f32, f32_messages = load_checked(OUT)
    logits, loss = run(f32, input_ids)
    reload_diff = (logits - logits_mem).abs().max().item()
    assert reload_diff == 0.0 and loss.item() == loss_mem.item(), (reload_diff, loss, loss_mem)

    b16, b16_messages = load_checked(BF16)
    for name, p in model.state_dict().items():  # the bf16 copy is the f32 weights rounded
        q = b16.state_dict()[name]
        assert q.dtype == torch.float32 and torch.equal(q, p.to(torch.bfloat16).float()), name
    logits_bf16, loss_bf16 = run(b16, input_ids)

    save_file({
        "input_ids": input_ids.contiguous(),
        "logits": logits.contiguous(),
        "loss": loss.reshape(()),
        "logits_bf16": logits_bf16.contiguous(),
        "loss_bf16": loss_bf16.reshape(()),
    }, str(OUT / "expected.safetensors"))

    attention = attention_figures(f32, input_ids)
    moved = sensitivity(f32, input_ids, logits)
    files = sorted(p for p in OUT.rglob("*") if p.is_file() and p.name != "expected.json")
    expected = {
        "about": "transformers' numbers for models/fixtures/hf-llama-tiny; "
                 "made by bench/hf_fixture/make_fixture.py",
        "input_ids_from": f"Hamlet (data/hamlet.txt.gz) from the line holding {PASSAGE_START!r}, "
                          f"first {n} tokens as {list(EXPECTED_SHAPE)}",
        "input_text": tok.decode(passage_ids),
        # JSON numbers; json writes floats with repr, the shortest text that reads back exactly.
        "loss": loss.item(),
        "loss_bf16": loss_bf16.item(),
        "loss_note": "mean cross-entropy of logits[:, :-1] against input_ids[:, 1:], computed in "
                     "float32 by transformers (labels=input_ids); bf16 = the bf16 folder loaded "
                     "with dtype=float32",
        "max_abs_logit": logits.abs().max().item(),
        "max_abs_logit_diff_bf16_vs_f32": (logits_bf16 - logits).abs().max().item(),
        "tokenizer_check": tok_check,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
        "config": json.loads((OUT / "config.json").read_text()),
        "training": {
            **TRAIN, "seed": SEED, "optimizer": "AdamW", "dtype": "float32", "device": "cpu",
            "data": "Hamlet, random windows of seq tokens; labels = inputs (shifted inside)",
            "first_loss": losses[0],
            "final_loss": final_loss,
            "mean_loss_last_20": sum(losses[-20:]) / 20,
        },
        "attention": attention,
        "logit_change_under_mistakes": moved,
        "load_messages": {"f32": f32_messages, "bf16": b16_messages},
        "sha256": {str(p.relative_to(OUT)): sha256(p) for p in files},
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")

    # Report.
    print(f"loss {loss.item()!r}, bf16 {loss_bf16.item()!r}, max |logit| {logits.abs().max().item():.3f}")
    print(f"attention: {json.dumps(attention)}")
    print(f"logit change under mistakes: {json.dumps(moved)}")
    for folder in (OUT, BF16):
        for name, row in describe(folder).items():
            print(f"  {folder.relative_to(REPO)}/{row['file']}: {name} {row['dtype']} {row['shape']}")
    total = 0
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            total += p.stat().st_size
            print(f"  {p.stat().st_size:8d}  {p.relative_to(REPO)}")
    print(f"  {total:8d}  in all; {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
